"""Trainer-side fetch: `fetch_rows` validation, and `fetch_and_broadcast` over 2 real gloo processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from replay.fetch import fetch_rows
from replay.storage import InMemoryRowStorage, StorageReadError, row_keys

REPO = str(Path(__file__).resolve().parents[1])


def make_rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = list(row_keys("bc", 5))
    resp = [3, 0, 1, 5, 2]
    cols = {
        "prompt_ids": [torch.randint(0, 2**40, (5,), generator=g) for _ in keys],
        "response_ids": [torch.randint(0, 2**40, (n,), generator=g) for n in resp],
        "gen_logprobs": [-torch.rand(n, generator=g) for n in resp],
        "response_mask": [torch.rand(n, generator=g) > 0.5 for n in resp],
        "reward": torch.rand(5, generator=g),
        "advantage": torch.randn(5, generator=g),
    }
    return keys, cols


def test_fetch_rows_validates():
    storage = InMemoryRowStorage()
    keys, cols = make_rows()
    storage.put_rows_sync(keys, cols)
    got = fetch_rows(storage, keys[::-1], ["reward", "response_ids"])
    assert list(got) == ["reward", "response_ids"]
    assert torch.equal(got["reward"], cols["reward"].flip(0))
    with pytest.raises(StorageReadError, match=r"missing keys \['zz_g0'\]"):
        fetch_rows(storage, keys + ["zz_g0"], ["reward"])
    with pytest.raises(StorageReadError, match=r"unknown fields \['logits'\]"):
        fetch_rows(storage, keys, ["logits"])

    class Short:  # a storage that returns a short column without complaining
        schema = storage.schema

        def get_rows_sync(self, keys, fields):
            return {"reward": torch.zeros(len(keys) - 1)}

    with pytest.raises(StorageReadError, match="field 'reward' has 4 rows for 5 keys"):
        fetch_rows(Short(), keys, ["reward"])


WORKER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch, torch.distributed as dist
    from replay.fetch import fetch_and_broadcast
    from replay.storage import InMemoryRowStorage, StorageReadError
    sys.path.insert(0, sys.argv[5])
    from test_fetch_broadcast import make_rows

    rank, init_file, out_dir = int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    keys, cols = make_rows()
    fields = ["prompt_ids", "response_ids", "gen_logprobs", "response_mask", "reward", "advantage"]
    result = {}

    # 1. default group, rank 0 reads
    storage = InMemoryRowStorage() if rank == 0 else None
    if storage is not None:
        storage.put_rows_sync(keys, cols)
    order = [3, 1, 4, 0, 2]
    got = fetch_and_broadcast(storage, [keys[i] for i in order], fields, None, 0)
    torch.save(got, f"{out_dir}/rank{rank}_default.pt")

    # 2. an explicit group, rank 1 reads
    group = dist.new_group([0, 1])
    storage = InMemoryRowStorage() if rank == 1 else None
    if storage is not None:
        storage.put_rows_sync(keys, cols)
    got = fetch_and_broadcast(storage, keys, ["reward", "response_mask"], group, 1)
    torch.save(got, f"{out_dir}/rank{rank}_group.pt")

    # 3. the source cannot read: every rank raises, nobody hangs
    try:
        fetch_and_broadcast(storage, keys + ["zz_g0"], ["reward"], group, 1)
    except StorageReadError as e:
        result["error"] = str(e)
    # 4. no rows
    got = fetch_and_broadcast(storage, [], ["response_ids", "reward"], group, 1)
    result["empty"] = [len(got["response_ids"]), got["reward"].shape[0]]
    dist.destroy_process_group()
    print("RESULT" + json.dumps(result))
    """
)


def test_fetch_and_broadcast_two_gloo_ranks(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    init_file = tmp_path / "rendezvous"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tests_dir = str(Path(__file__).resolve().parent)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), REPO, str(rank), str(init_file), str(tmp_path), tests_dir],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=90)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.split("RESULT", 1)[1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    keys, cols = make_rows()
    order = [3, 1, 4, 0, 2]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}_default.pt")
        for name, col in cols.items():
            if isinstance(col, list):
                assert [t.dtype for t in got[name]] == [col[i].dtype for i in order]
                assert all(torch.equal(g, col[i]) for g, i in zip(got[name], order)), (rank, name)
            else:
                assert got[name].dtype == col.dtype and torch.equal(got[name], col[order]), (rank, name)
        got = torch.load(tmp_path / f"rank{rank}_group.pt")
        assert torch.equal(got["reward"], cols["reward"])
        assert all(torch.equal(g, w) for g, w in zip(got["response_mask"], cols["response_mask"]))
    # the reader re-raises its own error; its sibling gets it by name
    assert "missing keys ['zz_g0']" in outs[1]["error"]
    assert (
        outs[0]["error"].startswith("rank 1 could not read the 6 rows") and "missing keys ['zz_g0']" in outs[0]["error"]
    )
    assert outs[0]["empty"] == outs[1]["empty"] == [0, 0]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_prefetched_rows_are_exactly_a_fresh_read_whole_partial_or_reordered():
    from replay.fetch import RowPrefetcher

    storage = InMemoryRowStorage()
    keys, cols = make_rows()
    storage.put_rows_sync(keys, cols)
    fields = ["prompt_ids", "response_ids", "reward"]
    pf = RowPrefetcher(storage)
    try:
        # one prefetch's keys, in its order: handed over whole
        pf.prefetch(keys, fields)
        got = pf.fetch(keys, fields)
        want = fetch_rows(storage, keys, fields)
        assert all(_same(got[f], want[f]) for f in fields) and set(got) == set(fields)
        assert pf.take_hit_rate() == 1.0
        # part of a prefetch, reordered, then the rest: assembled row by row, still exact
        pf.prefetch(keys, fields)
        part = keys[::-2]
        got = pf.fetch(part, ["reward", "response_ids"])
        want = fetch_rows(storage, part, ["reward", "response_ids"])
        assert all(_same(got[f], want[f]) for f in ("reward", "response_ids"))
        rest = [k for k in keys if k not in part]
        got = pf.fetch(rest, fields)
        assert all(_same(got[f], fetch_rows(storage, rest, fields)[f]) for f in fields)
        assert pf.take_hit_rate() == 1.0
        # a field the prefetch did not read: read again, all of it
        pf.prefetch(keys, ["reward"])
        got = pf.fetch(keys, ["reward", "prompt_ids"])
        assert _same(got["prompt_ids"], fetch_rows(storage, keys, ["prompt_ids"])["prompt_ids"])
        assert pf.take_hit_rate() == 0.0
    finally:
        pf.close()


def test_a_failed_prefetch_is_read_again_on_fetch():
    from replay.fetch import RowPrefetcher

    class FailsOnce(InMemoryRowStorage):
        failed = False

        def get_rows_sync(self, keys, fields):
            if not self.failed:
                self.failed = True
                raise StorageReadError("injected")
            return super().get_rows_sync(keys, fields)

    storage = FailsOnce()
    keys, cols = make_rows()
    storage.put_rows_sync(keys, cols)
    pf = RowPrefetcher(storage)
    try:
        pf.prefetch(keys, ["reward"])
        got = pf.fetch(keys, ["reward"])
        assert torch.equal(got["reward"], fetch_rows(storage, keys, ["reward"])["reward"])
        assert pf.take_hit_rate() == 0.0
    finally:
        pf.close()
