"""`fetch_and_broadcast` over 2 real gloo processes: what the reading rank fetched arrives on both, an explicit
group, a failed read raises on every rank, no rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.helpers.broadcast_rows import make_rows

REPO = str(Path(__file__).resolve().parents[2])


WORKER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch, torch.distributed as dist
    from replay.fetch import fetch_and_broadcast
    from replay.storage import InMemoryRowStorage, StorageReadError
    from tests.helpers.broadcast_rows import make_rows

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
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), REPO, str(rank), str(init_file), str(tmp_path)],
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
