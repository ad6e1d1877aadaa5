"""`sc-grpo bench storage`: latency of row-storage put / get / clear on a real TransferQueue.

Rows are the embedded task's (G = 16, prompt 5 + response 3 tokens, the fields a generation worker
writes, no tags), a step is 16 groups in one call; each repetition uses fresh keys, put -> get (what
a trainer reads) -> clear, and checks what it reads back. `async` is the controller's path, `sync`
the workers'; layouts `group` (one key per group, the default) and `row`; `local` times only this
layer's validation and encoding. Starts its own local Ray and TQ unless connected, and stops them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from replay.transferqueue.common import configure_env


def make_rows(prefix: str, num_groups: int, group_size: int, prompt_len: int, response_len: int, seed: int = 0):
    import torch

    from replay.storage import row_keys

    g = torch.Generator().manual_seed(seed)
    keys = [k for gi in range(num_groups) for k in row_keys(f"{prefix}-{gi}", group_size)]
    n = len(keys)
    columns = {
        "prompt_ids": [torch.randint(0, 12, (prompt_len,), generator=g) for _ in range(n)],
        "response_ids": [torch.randint(0, 12, (response_len,), generator=g) for _ in range(n)],
        "gen_logprobs": [-torch.rand(response_len, generator=g) for _ in range(n)],
        "response_mask": [torch.ones(response_len, dtype=torch.bool) for _ in range(n)],
        "token_versions": [torch.full((response_len,), seed, dtype=torch.int64) for _ in range(n)],
        "reward": torch.rand(n, generator=g),
    }
    return keys, columns


def _check_read(got: dict[str, Any], columns: dict[str, Any], fields: Sequence[str], what: str) -> None:
    """The rows read back are the rows written (a benchmark of wrong answers measures nothing)."""
    import torch

    for f in fields:
        want, have = columns[f], got[f]
        same = (
            torch.equal(torch.as_tensor(have), want)
            if isinstance(want, torch.Tensor)
            else (len(have) == len(want) and all(torch.equal(torch.as_tensor(h), w) for h, w in zip(have, want)))
        )
        if not same:
            raise AssertionError(f"{what}: field {f!r} read back differs from what was put")


def _percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    import numpy as np

    ms = np.asarray(samples_s) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean())}


def _record(times: dict[str, list[float]], t0: float, t1: float, t2: float, t3: float) -> None:
    times["put"].append(t1 - t0)
    times["get"].append(t2 - t1)
    times["clear"].append(t3 - t2)


def _shapes(args) -> list[tuple[str, int]]:
    return [("group", 1), ("step", args.groups_per_step)]


# One timed repetition: put, get (the fields a trainer rank reads), clear -> (rows read, 4 time stamps).
Rep = Callable[[list[str], dict[str, Any]], tuple[dict[str, Any], tuple[float, float, float, float]]]


async def _rep_async(storage, keys: list[str], columns: dict[str, Any]):
    from replay.storage import TRAIN_ROW_FIELDS

    t0 = time.perf_counter()
    await storage.put_rows(keys, columns)
    t1 = time.perf_counter()
    got = await storage.get_rows(keys, TRAIN_ROW_FIELDS)
    t2 = time.perf_counter()
    await storage.clear_rows(keys)
    return got, (t0, t1, t2, time.perf_counter())


def _rep_sync(storage, keys: list[str], columns: dict[str, Any]):
    from replay.storage import TRAIN_ROW_FIELDS

    t0 = time.perf_counter()
    storage.put_rows_sync(keys, columns)
    t1 = time.perf_counter()
    got = storage.get_rows_sync(keys, TRAIN_ROW_FIELDS)
    t2 = time.perf_counter()
    storage.clear_rows_sync(keys)
    return got, (t0, t1, t2, time.perf_counter())


def _bench_mode(args, mode: str, layout: str, rep_fn: Rep) -> list[dict[str, Any]]:
    """Every batch shape of one (mode, layout): `rep_fn` times each repetition, on fresh keys."""
    from replay.storage import TRAIN_ROW_FIELDS

    rows = []
    for label, num_groups in _shapes(args):
        reps = args.reps_group if label == "group" else args.reps_step
        times: dict[str, list[float]] = {"put": [], "get": [], "clear": []}
        for rep in range(args.warmup + reps):
            keys, columns = make_rows(
                f"{mode[0]}{layout}{label}{rep}", num_groups, args.group_size, args.prompt_len, args.response_len, rep
            )
            got, stamps = rep_fn(keys, columns)
            _check_read(got, columns, TRAIN_ROW_FIELDS, f"{mode} {layout} {label} repetition {rep}")
            if rep >= args.warmup:
                _record(times, *stamps)
        rows += _summarize(mode, layout, label, len(keys), columns, times)
    return rows


def _bench_local(storage, args, layout: str) -> list[dict[str, Any]]:
    rows = []
    for label, num_groups in _shapes(args):
        keys, columns = make_rows(f"l{label}", num_groups, args.group_size, args.prompt_len, args.response_len)
        times: dict[str, list[float]] = {"put": []}
        for rep in range(args.warmup + args.reps_group):
            t0 = time.perf_counter()
            storage.encode_put(keys, columns)
            if rep >= args.warmup:
                times["put"].append(time.perf_counter() - t0)
        rows += _summarize("local", layout, label, len(keys), columns, times, op_name="validate+encode")
    return rows


def run_bench(args, timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Every (mode, layout) asked for, on the TransferQueue this process is connected to; each
    layout in a partition of its own, emptied by the bench."""
    from replay.transferqueue.storage import TQRowStorage

    rows: list[dict[str, Any]] = []
    for layout in ("group", "row") if args.layout == "both" else (args.layout,):
        storage = TQRowStorage(
            f"bench-{layout}", timeout_s=timeout_s or args.timeout_s, track_resident=False, group_rows=layout == "group"
        )
        rows += _bench_layout(storage, args, layout)
    return rows


def _bench_layout(storage, args, layout: str) -> list[dict[str, Any]]:
    rows = _bench_local(storage, args, layout)
    if args.mode in ("async", "both"):
        with asyncio.Runner() as runner:  # one long-lived loop, as the controller's (TQ pools sockets per loop)
            rows += _bench_mode(args, "async", layout, lambda k, c: runner.run(_rep_async(storage, k, c)))
    if args.mode in ("sync", "both"):
        rows += _bench_mode(args, "sync", layout, lambda k, c: _rep_sync(storage, k, c))
    return rows


def _summarize(mode, layout, label, num_rows, columns, times, op_name: str | None = None) -> list[dict[str, Any]]:
    from replay.storage import column_nbytes

    nbytes = sum(column_nbytes(c) for c in columns.values())
    return [
        {
            "mode": mode,
            "layout": layout,
            "batch": label,
            "op": op_name or op,
            "rows": num_rows,
            "bytes": nbytes,
            "reps": len(ts),
            **_percentiles(ts),
        }
        for op, ts in times.items()
    ]


def _print(rows: list[dict[str, Any]], header: str, out: Callable[[str], None] = print) -> None:
    out(header)
    out(
        f"{'mode':<6} {'layout':<6} {'batch':<6} {'op':<17} {'rows':>5} {'bytes':>7} {'reps':>5} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}"
    )
    for r in rows:
        out(
            f"{r['mode']:<6} {r['layout']:<6} {r['batch']:<6} {r['op']:<17} {r['rows']:>5} {r['bytes']:>7} "
            f"{r['reps']:>5} "
            f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['mean_ms']:>8.2f}"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sc-grpo bench storage", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps-group", type=int, default=100, help="timed repetitions per group-sized call")
    p.add_argument("--reps-step", type=int, default=30, help="timed repetitions per step-sized call")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    p.add_argument("--group-size", type=int, default=16, help="rows per group (G)")
    p.add_argument("--groups-per-step", type=int, default=16, help="groups in one step batch")
    p.add_argument("--prompt-len", type=int, default=5)
    p.add_argument("--response-len", type=int, default=3)
    p.add_argument("--mode", choices=("async", "sync", "both"), default="both")
    p.add_argument(
        "--layout",
        choices=("group", "row", "both"),
        default="both",
        help="TQ keys per prompt group (`group`, storage.pack_groups: the default) or per row (`row`)",
    )
    p.add_argument("--storage-units", type=int, default=1, help="TQ storage units")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the local Ray (default: 2 + units)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="deadline of each storage call")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_env()
    import ray

    from replay.transferqueue.runtime import start_tq, stop_tq

    own_ray = not ray.is_initialized()
    t0 = time.perf_counter()
    if own_ray:
        num_cpus = args.num_cpus if args.num_cpus is not None else 2 + args.storage_units
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    t_ray = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    try:
        info = start_tq(args.storage_units)
        rows += run_bench(args)
    finally:
        stop_tq()
        if own_ray:
            ray.shutdown()
    _print(
        rows,
        f"replay/tq bench: TQ {args.storage_units} storage unit(s), TQ_NUM_THREADS={os.environ.get('TQ_NUM_THREADS')}, "
        f"ray.init {t_ray:.1f}s, tq start {info.startup_s:.1f}s; G={args.group_size}, "
        f"prompt {args.prompt_len} + response {args.response_len} tokens; step = {args.groups_per_step} groups",
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ray_init_s": t_ray, "tq_start_s": info.startup_s}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
