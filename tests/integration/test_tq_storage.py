"""Row storage against a real TransferQueue on a local Ray, and the same behaviour on InMemoryRowStorage.

One module-scoped Ray + TQ (ray.init ~5 s, tq.init ~7 s); every test uses its own partition.
Storage-agnostic tests are parametrized over `memory` and `tq`: both must validate identically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from replay.storage import (
    GENERATION_FIELDS,
    ROLLOUT_SCHEMA,
    TRAIN_FIELDS,
    InMemoryRowStorage,
    RowStorage,
    StorageReadError,
    StorageWriteError,
    column_nbytes,
    row_keys,
)
from single_controller.deadlines import DeadlineExceeded

REPO = str(Path(__file__).resolve().parents[2])


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def leak_probe(tmp_path_factory):
    """The start/stop leak check runs in its own process (its own Ray). It is launched before this
    module's Ray so that the two startups, mostly spent waiting on process spawns, overlap."""
    script = tmp_path_factory.mktemp("leak") / "leak.py"
    script.write_text(LEAK_SCRIPT)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, str(script), REPO], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:  # the test did not wait for it (deselected or failed early)
            proc.communicate(timeout=120)


@pytest.fixture(scope="module")
def tq_cluster(leak_probe):
    from replay.transferqueue.common import configure_env

    configure_env()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from replay.transferqueue.runtime import start_tq, stop_tq

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield start_tq(num_storage_units=1)
    finally:
        stop_tq()
        ray.shutdown()


def new_tq_storage(**kw):
    from replay.transferqueue.storage import TQRowStorage

    return TQRowStorage(f"test-{uuid.uuid4().hex[:8]}", **kw)


@pytest.fixture(params=["memory", pytest.param("tq", marks=pytest.mark.tq)])
def storage(request):
    if request.param == "memory":
        return InMemoryRowStorage()
    request.getfixturevalue("tq_cluster")
    return new_tq_storage(timeout_s=30.0)


# ---------------------------------------------------------------- helpers
def make_rows(group_id: str, group_size: int = 4, seed: int = 0):
    """Rows with every schema dtype; response lengths 0..7 (a 0-length row is the jagged edge case)."""
    g = torch.Generator().manual_seed(seed)
    keys = list(row_keys(group_id, group_size))
    resp = [(i * 3) % 8 for i in range(group_size)]  # 0, 3, 6, 1, ...
    cols = {
        "prompt_ids": [torch.randint(0, 2**40, (5,), generator=g) for _ in keys],  # beyond int32
        "response_ids": [torch.randint(0, 2**40, (n,), generator=g) for n in resp],
        "gen_logprobs": [-torch.rand(n, generator=g) * 30 for n in resp],
        "response_mask": [torch.rand(n, generator=g) > 0.5 for n in resp],
        "token_versions": [torch.randint(0, 2**40, (n,), generator=g) for n in resp],
        "reward": torch.rand(group_size, generator=g),
    }
    tags = [{"group": group_id, "i": i, "version": 3} for i in range(group_size)]
    return keys, cols, tags


def assert_columns_equal(got, want, order):
    """`got` rows are `want` rows permuted by `order`, exactly (values and dtypes)."""
    for name, col in want.items():
        spec = ROLLOUT_SCHEMA[name]
        if spec.jagged:
            assert len(got[name]) == len(order)
            for g, i in zip(got[name], order):
                assert g.dtype == spec.dtype and g.dim() == 1
                assert torch.equal(g, col[i]), name
        else:
            assert got[name].dtype == spec.dtype and got[name].shape == (len(order),)
            assert torch.equal(got[name], col[order]), name


def run(loop, aw):
    return loop.run_until_complete(aw)


def read_tags(loop, storage, keys):
    if isinstance(storage, InMemoryRowStorage):
        return [storage.tags(k) for k in keys]
    listing = run(loop, storage.list_rows())
    return [listing[k] for k in keys]


def resident(loop, storage):
    return run(loop, storage.resident_keys())


# ---------------------------------------------------------------- behaviour, both storages
def test_round_trip_exact_in_keys_order(storage, loop):
    assert isinstance(storage, RowStorage)
    keys, cols, tags = make_rows("rt", 6)
    run(loop, storage.put_rows(keys, cols, tags))
    order = [4, 0, 5, 2, 1, 3]
    got = run(loop, storage.get_rows([keys[i] for i in order], GENERATION_FIELDS))
    assert list(got) == list(GENERATION_FIELDS)
    assert_columns_equal(got, cols, order)
    assert read_tags(loop, storage, keys) == tags

    # advantages are written back later under the same keys: a new column, tags merged
    adv = torch.tensor([0.5, -1.0, 0.0, 2.0, -0.25, 1e-7])
    run(loop, storage.put_rows(keys, {"advantage": adv}, [{"step": 7}] * 6))
    got = run(loop, storage.get_rows(keys[::-1], TRAIN_FIELDS))
    assert torch.equal(got["advantage"], adv.flip(0))
    assert_columns_equal(
        {k: v for k, v in got.items() if k != "advantage"},
        {k: cols[k] for k in TRAIN_FIELDS if k in cols},
        list(range(5, -1, -1)),
    )
    assert read_tags(loop, storage, keys[:1]) == [{**tags[0], "step": 7}]


def test_equal_length_and_ragged_groups_read_back_together(storage, loop):
    # TQRowStorage sends a jagged field whose rows share one length as a dense [B, L] tensor, and
    # varying lengths as a NestedTensor; rows of both kinds must read back exactly, interleaved.
    keys_a, cols_a, _ = make_rows("even", 3, seed=2)
    cols_a = {**cols_a, "response_ids": [torch.arange(3) * (i + 1) for i in range(3)]}
    keys_b, cols_b, _ = make_rows("ragged", 3, seed=3)
    run(loop, storage.put_rows(keys_a, cols_a))
    run(loop, storage.put_rows(keys_b, cols_b))
    keys = [keys_b[2], keys_a[0], keys_b[0], keys_a[2], keys_a[1], keys_b[1]]
    got = run(loop, storage.get_rows(keys, GENERATION_FIELDS))
    both = {
        f: (list(cols_a[f]) + list(cols_b[f])) if ROLLOUT_SCHEMA[f].jagged else torch.cat([cols_a[f], cols_b[f]])
        for f in cols_a
    }
    assert_columns_equal(got, both, [5, 0, 3, 2, 1, 4])


def test_sync_twins_round_trip(storage, loop):
    keys, cols, tags = make_rows("sync", 5, seed=1)
    storage.put_rows_sync(keys, cols, tags)
    got = storage.get_rows_sync(keys[::-1], GENERATION_FIELDS)
    assert_columns_equal(got, cols, [4, 3, 2, 1, 0])
    storage.clear_rows_sync(keys)
    assert resident(loop, storage) == set()


def test_short_read_names_missing_keys(storage, loop):
    keys, cols, _ = make_rows("short", 3)
    run(loop, storage.put_rows(keys, cols))
    with pytest.raises(StorageReadError, match=r"missing keys \['nope_g0', 'nope_g1'\] \(2 of 4\)"):
        run(loop, storage.get_rows([keys[0], "nope_g0", keys[2], "nope_g1"], ["reward", "response_ids"]))
    with pytest.raises(StorageReadError, match=r"missing keys \['nope_g0'\] \(1 of 1\)"):
        run(loop, storage.get_rows(["nope_g0"], ["reward"]))


def test_short_read_names_missing_fields(storage, loop):
    keys, cols, _ = make_rows("field", 3)
    run(loop, storage.put_rows(keys, cols))
    with pytest.raises(StorageReadError, match=r"missing fields \['advantage'\]"):
        run(loop, storage.get_rows(keys, ["reward", "advantage"]))
    # a field only some rows have is absent too
    run(loop, storage.put_rows(keys[:1], {"advantage": torch.tensor([1.0])}))
    with pytest.raises(StorageReadError, match=r"missing fields \['advantage'\]") as e:
        run(loop, storage.get_rows(keys, ["advantage"]))
    assert "missing keys" not in str(e.value)
    with pytest.raises(StorageReadError, match=r"unknown fields \['logits'\]"):
        run(loop, storage.get_rows(keys, ["logits"]))


def test_a_put_of_bulk_fields_replaces_all_of_the_rows_bulk_fields(storage, loop):
    # TQRowStorage packs a row's bulk fields into one TQ field; the in-memory storage behaves the same
    keys, cols, _ = make_rows("rebulk", 3, seed=4)
    run(loop, storage.put_rows(keys, cols))
    new_ids = [torch.arange(i + 2) for i in range(3)]
    run(loop, storage.put_rows(keys, {"response_ids": new_ids}))
    got = run(loop, storage.get_rows(keys, ["response_ids", "reward"]))
    assert all(torch.equal(g, w) for g, w in zip(got["response_ids"], new_ids))
    assert torch.equal(got["reward"], cols["reward"])  # scalar fields are untouched
    with pytest.raises(StorageReadError, match=r"missing fields \['prompt_ids', 'gen_logprobs'\]"):
        run(loop, storage.get_rows(keys, ["prompt_ids", "response_ids", "gen_logprobs"]))


def test_clear_leaves_zero_keys(storage, loop):
    keys, cols, tags = make_rows("clear", 8)
    run(loop, storage.put_rows(keys, cols, tags))
    assert resident(loop, storage) == set(keys)
    assert storage.statistics().resident_rows == 8
    run(loop, storage.clear_rows(keys[:3]))
    assert resident(loop, storage) == set(keys[3:])
    run(loop, storage.clear_rows(keys[3:] + ["never_put_g0"]))  # unknown keys: no-op
    assert resident(loop, storage) == set()
    assert storage.statistics().resident_rows == 0
    with pytest.raises(StorageReadError, match="missing keys"):
        run(loop, storage.get_rows(keys[:1], ["reward"]))


@pytest.mark.parametrize(
    "field, bad",
    [
        ("reward", lambda c: c["reward"].double()),
        ("response_ids", lambda c: [t.int() for t in c["response_ids"]]),
        ("response_mask", lambda c: [t.to(torch.uint8) for t in c["response_mask"]]),
    ],
)
def test_dtype_change_refused_before_the_store(storage, loop, field, bad):
    keys, cols, _ = make_rows("dtype", 3)
    cols = {**cols, field: bad(cols)}
    with pytest.raises(StorageWriteError, match=rf"field '{field}' dtype .* != schema"):
        run(loop, storage.put_rows(keys, cols))
    assert resident(loop, storage) == set()  # the store never saw the keys
    assert storage.statistics().puts == 0


def test_bad_puts_register_nothing(storage, loop):
    keys, cols, tags = make_rows("bad", 3)
    dup = [keys[0], keys[1], keys[0]]
    with pytest.raises(StorageWriteError, match="duplicate keys"):
        run(loop, storage.put_rows(dup, cols, tags))
    with pytest.raises(StorageWriteError, match="2 tags for 3 keys"):
        run(loop, storage.put_rows(keys, cols, tags[:2]))
    with pytest.raises(StorageWriteError, match="field 'reward' has 2 rows for 3 keys"):
        run(loop, storage.put_rows(keys, {**cols, "reward": cols["reward"][:2]}))
    with pytest.raises(StorageWriteError, match="must be one 1-D tensor per row"):
        run(loop, storage.put_rows(keys, {"prompt_ids": [t.view(1, -1) for t in cols["prompt_ids"]]}))
    with pytest.raises(StorageWriteError, match="unknown field 'logits'"):
        run(loop, storage.put_rows(keys, {"logits": cols["reward"]}))
    assert resident(loop, storage) == set()


def test_statistics_count_this_clients_bytes(storage, loop):
    keys, cols, _ = make_rows("stats", 4)
    run(loop, storage.put_rows(keys, cols))
    run(loop, storage.get_rows(keys, ["response_ids", "reward"]))
    run(loop, storage.clear_rows(keys))
    s = storage.statistics()
    assert (s.puts, s.gets, s.clears, s.rows_put, s.rows_read) == (1, 1, 1, 4, 4)
    assert s.bytes_put == sum(column_nbytes(c) for c in cols.values())
    assert s.bytes_read == column_nbytes(cols["response_ids"]) + 4 * 4  # int64 rows + 4 float32 rewards
    assert s.resident_rows == 0


# ---------------------------------------------------------------- TQ only


@pytest.mark.tq
def test_tq_rows_hold_the_bulk_fields_in_one_packed_field(tq_cluster, loop):
    from replay.transferqueue.common import import_transfer_queue
    from replay.transferqueue.storage import PACKED_FIELD

    tq = import_transfer_queue()
    storage = new_tq_storage(timeout_s=30.0)
    keys, cols, _ = make_rows("packed", 4, seed=5)
    run(loop, storage.put_rows(keys, cols))
    td = run(
        loop, tq.async_kv_batch_get(keys=keys, partition_id=storage.partition, select_fields=[PACKED_FIELD, "reward"])
    )
    assert td.batch_size[0] == 4 and set(td.keys()) == {PACKED_FIELD, "reward"}
    assert td.get(PACKED_FIELD).dtype == torch.uint8
    got = run(loop, storage.get_rows(keys, GENERATION_FIELDS))
    assert_columns_equal(got, cols, [0, 1, 2, 3])


# ---------------------------------------------------------------- group-packed layout (storage.pack_groups)
def _strip(cols, names):
    return {k: v for k, v in cols.items() if k in names}


@pytest.mark.tq
def test_group_packed_rows_read_back_exactly_in_any_order_and_subset(tq_cluster, loop):
    """One TQ key per group; rows still read by their own keys, any subset, any order: the same
    columns as the in-memory storage, every dtype, 0-length responses, groups of 1 to 16 rows."""
    import random

    from replay.transferqueue.common import import_transfer_queue
    from replay.transferqueue.storage import PACKED_FIELD

    store, mem = new_tq_storage(timeout_s=30.0, group_rows=True), InMemoryRowStorage()
    keys = []
    for gi, n in enumerate((1, 4, 16, 3)):
        k, cols, _ = make_rows(f"s3_q{gi}", n, seed=gi)
        run(loop, store.put_rows(k, cols))
        mem.put_rows_sync(k, cols)
        keys += k
    listing = run(loop, import_transfer_queue().async_kv_list(partition_id=store.partition))[store.partition]
    assert {g: t["rows"] for g, t in listing.items()} == {"s3_q0": 1, "s3_q1": 4, "s3_q2": 16, "s3_q3": 3}
    td = run(
        loop,
        import_transfer_queue().async_kv_batch_get(
            keys=["s3_q1"], partition_id=store.partition, select_fields=[PACKED_FIELD, "reward"]
        ),
    )
    # every field is a byte string: a tensor would come back as a jagged NestedTensor, whose
    # construction imports torch._dynamo (~1.3 s of CPU) in the reading process
    assert all(isinstance(v, bytes) for name in (PACKED_FIELD, "reward") for v in td.get(name).tolist())
    raw = td.get("reward").tolist()  # the group's [n] vector
    assert (
        td.batch_size[0] == 1
        and len(raw) == 1
        and torch.frombuffer(bytearray(raw[0]), dtype=torch.float32).numel() == 4
    )
    rng = random.Random(0)
    for ask in (keys, keys[::-1], rng.sample(keys, 9), [keys[5]]):
        got, want = run(loop, store.get_rows(ask, GENERATION_FIELDS)), mem.get_rows_sync(ask, GENERATION_FIELDS)
        assert_columns_equal(got, want, list(range(len(ask))))
    # a put of some fields of whole groups: a scalar added, the bulk replaced (as in any storage)
    k1 = list(row_keys("s3_q1", 4))
    adv = {"advantage": torch.tensor([0.5, -1.0, 2.0, 0.0])}
    _, new_bulk, _ = make_rows("s3_q1", 4, seed=9)
    for s in (store, mem):
        run(loop, s.put_rows(k1, adv))
        run(loop, s.put_rows(k1, _strip(new_bulk, {"response_ids", "gen_logprobs"})))
    ask = [k1[3], k1[0]]
    got, want = (
        run(loop, store.get_rows(ask, ["advantage", "response_ids", "reward"])),
        mem.get_rows_sync(ask, ["advantage", "response_ids", "reward"]),
    )
    assert_columns_equal(got, want, [0, 1])
    assert run(loop, store.resident_keys()) == set(keys) and store.statistics().resident_rows == 24
    run(loop, store.clear_rows(keys))
    assert run(loop, store.resident_keys()) == set() and store.statistics().resident_rows == 0


@pytest.mark.tq
def test_group_packed_storage_refuses_partial_groups_and_names_missing_rows(tq_cluster, loop):
    store = new_tq_storage(timeout_s=30.0, group_rows=True)
    keys, cols, tags = make_rows("s4_q0", 4, seed=1)
    with pytest.raises(StorageWriteError, match=r"whole groups: groups \['s4_q0'\] are not whole"):
        run(loop, store.put_rows(keys[1:], {k: (v[1:]) for k, v in cols.items()}))  # _g0 missing
    with pytest.raises(StorageWriteError, match=r"not row keys"):
        run(loop, store.put_rows(["plain"], {"reward": torch.ones(1)}))
    with pytest.raises(StorageWriteError, match="no per-row tags"):
        run(loop, store.put_rows(keys, cols, tags))
    assert run(loop, store.resident_keys()) == set()  # nothing reached TQ
    run(loop, store.put_rows(keys, _strip(cols, {"response_ids", "reward"})))
    for ask, named in ((["s4_q0_g4"], "s4_q0_g4"), (["s4_q9_g0", keys[0]], "s4_q9_g0"), (["bare"], "bare")):
        with pytest.raises(StorageReadError, match=f"missing keys \\['{named}'\\]"):
            run(loop, store.get_rows(ask, ["reward"]))
    with pytest.raises(StorageReadError, match="missing fields \\['gen_logprobs'\\]"):
        run(loop, store.get_rows(keys, ["response_ids", "gen_logprobs"]))
    with pytest.raises(StorageReadError, match="missing fields \\['advantage'\\]"):
        run(loop, store.get_rows(keys, ["advantage"]))
    run(loop, store.clear_rows(keys))


@pytest.mark.tq
def test_tq_and_memory_raise_identical_errors(tq_cluster, loop):
    tq_store, mem = new_tq_storage(), InMemoryRowStorage()
    keys, cols, tags = make_rows("same", 4)
    for s in (tq_store, mem):
        run(loop, s.put_rows(keys, cols, tags))
    cases = [
        lambda s: s.get_rows([keys[1], "x_g9", keys[0]], ["reward", "prompt_ids"]),
        lambda s: s.get_rows(["x_g9"], ["reward"]),
        lambda s: s.get_rows(keys, ["advantage", "reward"]),
        lambda s: s.put_rows(keys, {**cols, "reward": cols["reward"].half()}),
        lambda s: s.put_rows(keys + keys[:1], cols, tags),
    ]
    for case in cases:
        messages = []
        for s in (tq_store, mem):
            with pytest.raises((StorageReadError, StorageWriteError)) as e:
                run(loop, case(s))
            messages.append((type(e.value), str(e.value)))
        assert messages[0] == messages[1]


@pytest.mark.tq
def test_tq_drop_partition_only_when_empty_and_never_anothers(tq_cluster, loop):
    # Runs sharing one TransferQueue: a run's end drops its own partition once empty, and only it.
    import transfer_queue as tq

    mine, other = new_tq_storage(timeout_s=30.0), new_tq_storage(timeout_s=30.0)
    keys, cols, tags = make_rows("g0")
    run(loop, mine.put_rows(keys, cols, tags))
    run(loop, other.put_rows(keys, cols, tags))  # the same key names, in another partition
    assert run(loop, mine.drop_partition_if_empty()) is False  # still holds rows: kept
    run(loop, mine.clear_rows(keys))
    assert run(loop, mine.drop_partition_if_empty()) is True
    partitions = tq.get_client().get_partition_list()
    assert mine.partition not in partitions and other.partition in partitions
    assert set(run(loop, other.list_rows())) == set(keys)  # untouched
    assert run(loop, mine.drop_partition_if_empty()) is False  # gone already: a no-op


def test_tq_deadline_names_the_call_and_client_survives(tq_cluster, loop):
    keys, cols, _ = make_rows("deadline", 2)
    fast = new_tq_storage(timeout_s=1e-6)  # expires at the first network await
    with pytest.raises(DeadlineExceeded, match=rf"TQ put of 2 rows in partition '{fast.partition}'"):
        run(loop, fast.put_rows(keys, cols))
    # The get's own call, or (the put above never landed, so the read comes back short) the kv_list that
    # names what is missing: which deadline fires first depends on the moment; either names its call.
    with pytest.raises(DeadlineExceeded, match=r"TQ get of 2 rows|TQ kv_list\('"):
        fast.get_rows_sync(keys, ["reward"])
    # cancelled calls poison only their own sockets: a normal client on the same loops still works
    ok = new_tq_storage(timeout_s=30.0)
    run(loop, ok.put_rows(keys, cols))
    assert torch.equal(ok.get_rows_sync(keys, ["reward"])["reward"], cols["reward"])
    assert torch.equal(run(loop, ok.get_rows(keys, ["reward"]))["reward"], cols["reward"])


@pytest.mark.tq
def test_tq_put_cut_short_is_an_error_on_read_not_a_short_read(tq_cluster, loop):
    import transfer_queue as tq

    storage = new_tq_storage(timeout_s=30.0)
    keys, cols, _ = make_rows("orphan", 2)
    run(loop, storage.put_rows(keys, cols))
    # What a put cancelled between TQ's key registration and its data write leaves: keys, no data.
    run(loop, tq.get_client().async_kv_retrieve_meta(keys=["orphan_g9"], partition_id=storage.partition, create=True))
    with pytest.raises(StorageReadError, match=r"keys \['orphan_g9'\] are registered .* without data"):
        run(loop, storage.get_rows([keys[0], "orphan_g9"], ["reward"]))


@pytest.mark.tq
def test_worker_actor_attaches_and_reads_one_hop(tq_cluster, loop):
    import ray

    from replay.fetch import fetch_rows

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, repo: str, partition: str):
            sys.path.insert(0, repo)
            from replay.transferqueue.storage import TQRowStorage

            self.storage = TQRowStorage.attach(partition, timeout_s=30.0)

        def read(self, keys, fields):
            from replay.fetch import fetch_rows

            got = fetch_rows(self.storage, keys, fields)
            return {f: [t.tolist() for t in v] if isinstance(v, list) else v.tolist() for f, v in got.items()}

        def put_group(self, keys, seed):
            import torch

            g = torch.Generator().manual_seed(seed)
            cols = {
                "prompt_ids": [torch.randint(0, 9, (n + 1,), generator=g) for n in range(len(keys))],
                "reward": torch.rand(len(keys), generator=g),
            }
            self.storage.put_rows_sync(keys, cols, [{"by": "worker"}] * len(keys))
            return {"prompt_ids": [t.tolist() for t in cols["prompt_ids"]], "reward": cols["reward"].tolist()}

        def stats(self):
            return self.storage.statistics()

    storage = new_tq_storage(timeout_s=30.0)
    keys, cols, tags = make_rows("hop", 4)
    run(loop, storage.put_rows(keys, cols, tags))
    worker = Worker.remote(REPO, storage.partition)
    try:
        got = ray.get(worker.read.remote(keys[::-1], ["response_ids", "gen_logprobs", "reward"]), timeout=60)
        assert got["response_ids"] == [t.tolist() for t in cols["response_ids"][::-1]]
        assert got["gen_logprobs"] == [t.tolist() for t in cols["gen_logprobs"][::-1]]
        assert got["reward"] == cols["reward"].flip(0).tolist()
        # and the other way: the worker puts (generation path), the driver reads
        wkeys = list(row_keys("hop-w", 3))
        sent = ray.get(worker.put_group.remote(wkeys, 5), timeout=60)
        back = fetch_rows(storage, wkeys, ["prompt_ids", "reward"])
        assert [t.tolist() for t in back["prompt_ids"]] == sent["prompt_ids"]
        assert back["reward"].tolist() == sent["reward"]
        wstats = ray.get(worker.stats.remote(), timeout=60)
        assert (wstats.gets, wstats.rows_read, wstats.puts, wstats.rows_put) == (1, 4, 1, 3)
    finally:
        ray.kill(worker)


def test_bench_storage_times_every_mode_and_layout_on_the_rows_a_worker_writes(tq_cluster, monkeypatch):
    """`sc-grpo bench storage` puts what a generation worker writes (every generation field, no
    tags), reads what a trainer rank reads, and refuses to report figures for wrong answers."""
    from replay.storage import GENERATION_FIELDS
    from replay.transferqueue.storage import TQRowStorage
    from single_controller.bench import tq as tq_bench

    args = tq_bench.parse_args(["--reps-group", "2", "--reps-step", "1", "--warmup", "0", "--groups-per-step", "3"])
    keys, columns = tq_bench.make_rows("x", 2, 4, 5, 3)
    assert set(columns) == set(GENERATION_FIELDS) and len(keys) == 8
    rows = tq_bench.run_bench(args, timeout_s=30.0)
    got = {(r["mode"], r["layout"], r["batch"], r["op"]): r for r in rows}
    for layout in ("group", "row"):
        assert got[("local", layout, "step", "validate+encode")]["rows"] == 3 * 16
        for mode in ("async", "sync"):
            for op in ("put", "get", "clear"):
                assert got[(mode, layout, "group", op)]["reps"] == 2 and got[(mode, layout, "group", op)]["p50_ms"] > 0
                assert got[(mode, layout, "step", op)]["rows"] == 3 * 16
    assert len(rows) == 2 * (2 + 2 * 2 * 3)

    # a storage that reads back other values than it was given: the bench stops, naming the field
    real_get = TQRowStorage.get_rows

    async def corrupt(self, keys, fields):
        out = await real_get(self, keys, fields)
        out["gen_logprobs"] = [t + 1 for t in out["gen_logprobs"]]
        return out

    monkeypatch.setattr(TQRowStorage, "get_rows", corrupt)
    with pytest.raises(AssertionError, match="'gen_logprobs' read back differs"):
        tq_bench.run_bench(
            tq_bench.parse_args(
                ["--reps-group", "1", "--reps-step", "1", "--warmup", "0", "--mode", "async", "--layout", "group"]
            )
        )


LEAK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, sys.argv[1])
    from replay.transferqueue.common import configure_env, TQRuntimeError
    from replay.transferqueue.runtime import start_tq, stop_tq
    configure_env()
    import psutil, ray, torch
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    out = {}
    t0 = time.perf_counter()
    try:
        start_tq(num_storage_units=2)  # needs 3 CPUs: must refuse, not hang
    except TQRuntimeError as e:
        out["refused"] = str(e)
    out["refuse_s"] = time.perf_counter() - t0
    from replay.transferqueue.storage import TQRowStorage
    try:
        TQRowStorage("leak")  # no client in this process yet
    except TQRuntimeError as e:
        out["no_client"] = str(e)
    me = psutil.Process()
    import replay.transferqueue.host
    supported = replay.transferqueue.host.layout_supported
    # the default (controller and unit in one process), TQ's own layout, and the fallback to it when
    # the installed TransferQueue is not laid out as the host needs (the host is then replaced)
    for layout, one_process in (("one", True), ("per_actor", False), ("fallback", True)):
        replay.transferqueue.host.layout_supported = (lambda: False) if layout == "fallback" else supported
        while ray.available_resources().get("CPU", 0) < 2:  # a killed actor's CPU comes back a moment later
            time.sleep(0.05)
        start_tq(num_storage_units=1, one_process=one_process)
        s = TQRowStorage("leak", timeout_s=30)
        s.put_rows_sync(["k_g0"], {"reward": torch.tensor([0.5])})
        out["read_" + layout] = s.get_rows_sync(["k_g0"], ["reward"])["reward"].tolist()
        out["pids_" + layout] = {p.pid: " ".join(p.cmdline()) for p in me.children(recursive=True)}
        stop_tq(); stop_tq()          # idempotent
    ray.shutdown()
    stop_tq()                     # safe after ray.shutdown too
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.tq
def test_start_refuses_too_few_cpus_and_stop_leaves_no_processes_in_each_layout(leak_probe):
    import psutil

    stdout, stderr = leak_probe.communicate(timeout=120)
    assert leak_probe.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.split("RESULT", 1)[1])
    assert "needs 3 free logical Ray CPUs" in out["refused"] and out["refuse_s"] < 5
    assert "no TransferQueue client in this process" in out["no_client"]

    def tq_processes(layout):
        names = ("TransferQueueHost", "TransferQueueController", "SimpleStorageUnit")
        return sorted(n for c in out["pids_" + layout].values() for n in names if f"ray::{n}" in c)

    for layout in ("one", "per_actor", "fallback"):
        assert out["read_" + layout] == [0.5], layout
    # we did see TQ's processes: one host, or a controller and a unit
    assert tq_processes("one") == ["TransferQueueHost"]
    assert tq_processes("per_actor") == tq_processes("fallback") == ["SimpleStorageUnit", "TransferQueueController"]
    pids = {pid: cmd for layout in ("one", "per_actor", "fallback") for pid, cmd in out["pids_" + layout].items()}
    deadline = time.monotonic() + 10  # ray.shutdown reaps asynchronously
    while True:
        alive = []
        for pid, cmd in pids.items():
            try:
                p = psutil.Process(int(pid))
                if p.status() != psutil.STATUS_ZOMBIE and " ".join(p.cmdline()) == cmd:
                    alive.append(cmd)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert alive == [], f"left running: {alive}"
