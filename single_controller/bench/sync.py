"""`sc-grpo bench sync`: one weight sync, trainer rank → generation workers, by each transport, beside
the raw cost of moving the same bytes.

A sender actor publishes a Llama-shaped model in `--dtype` as a trainer rank does; receivers load it
as a torch generation worker does, driven by the controller's own client, and every sync is checked
bit for bit. Columns (median of `--repeats` after three warm-ups, each transport in fresh processes):
`publish_s` (trainer side), `deliver_s` (workers), `sync_s` (both), `raw_bcast_s` (a bare gloo or
NCCL broadcast of the same bytes), `memcpy_s`, and `x raw` = `deliver_s` / `raw_bcast_s`. Starts its
own local Ray unless this process is connected.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

from single_controller.backends.common.weight_broadcast import WeightSender


def parse_size(text: str) -> int:
    """`10M`, `1.5G`, `2000000`: a parameter count."""
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9}.get(text[-1:].upper())
    return int(float(text[:-1]) * scale) if scale else int(float(text))


def model_shapes(num_params: int) -> list[tuple[str, tuple[int, ...]]]:
    """Named shapes adding up to about `num_params`: per layer four hidden x hidden matrices, two
    hidden x 4 hidden ones and a norm gain (a Llama block's proportions), as many layers as fit
    (hidden 1024 from 50 M parameters, else 512)."""
    hidden = 1024 if num_params >= 50_000_000 else 512
    per_layer = 4 * hidden * hidden + 2 * hidden * 4 * hidden + hidden
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(max(1, num_params // per_layer)):
        for name in ("q", "k", "v", "o"):
            shapes.append((f"layers.{i}.{name}.weight", (hidden, hidden)))
        shapes.append((f"layers.{i}.up.weight", (4 * hidden, hidden)))
        shapes.append((f"layers.{i}.down.weight", (hidden, 4 * hidden)))
        shapes.append((f"layers.{i}.norm.weight", (hidden,)))
    return shapes


def _tensors(
    shapes: Sequence[tuple[str, tuple[int, ...]]], dtype: Any, seed: int | None, device: str = "cpu"
) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return {n: (torch.randn(s, generator=g) if g is not None else torch.zeros(s)).to(device, dtype) for n, s in shapes}


def _device(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


class BenchSender(WeightSender):
    """A trainer rank's publishing side, alone: float32 masters, `pack_weights` to the wire dtype,
    and the `WeightSender` methods the client calls, as a trainer rank actor has them."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]], dtype: str, bucket_mb: float, backend: str):
        import torch

        torch.set_num_threads(1)
        self.backend = backend
        self.params = _tensors(shapes, torch.float32, seed=0, device=_device(backend))
        self.dtype, self.bucket_bytes = getattr(torch, dtype), int(bucket_mb * (1 << 20))
        self.raw: Any = None
        self.raw_buffer: Any = None

    def export(self, version: int, transport: str) -> Any:
        import ray

        from single_controller.backends.common.weights import WeightSnapshot, pack_weights
        from single_controller.types import WeightsHandle

        spare = self.make_room() if transport == "collective" else None
        snap = pack_weights(self.params, version, self.bucket_bytes, dtype=self.dtype, into=spare)
        if transport == "collective":
            payload: Any = self.stage_weights(snap, ray.get_runtime_context().current_actor)
        else:
            payload = WeightSnapshot(snap.manifest, [ray.put(b) for b in snap.buckets])
        return WeightsHandle(version, payload, snap.manifest.num_bytes)

    def expected(self) -> dict[str, Any]:
        return {n: t.to(self.dtype) for n, t in self.params.items()}

    # the raw references
    def raw_open(self, addr: Any) -> None:
        from single_controller.backends.common.weight_broadcast import open_group

        self.sync_address()  # the store exists
        self.raw = open_group(addr, 0, store=self._sync_store)

    def raw_broadcast(self, nbytes: int) -> float:
        import torch

        from single_controller.backends.common.weight_broadcast import broadcast_buckets

        if self.raw_buffer is None or len(self.raw_buffer) != nbytes:  # one buffer, as the transports reuse theirs
            self.raw_buffer = torch.ones(nbytes, dtype=torch.uint8, device=_device(self.backend))
        t0 = time.perf_counter()
        broadcast_buckets(self.raw, [self.raw_buffer], self.backend)
        if self.backend == "nccl":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def memcpy(self, nbytes: int) -> float:
        import torch

        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)  # touch both once
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0


class BenchReceiver:
    """A generation worker's receiving side, alone: its tensors in the wire dtype, `load_snapshot`."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]], dtype: str, backend: str):
        import torch
        from torch import nn

        from single_controller.backends.common.weight_broadcast import WeightReceiver

        torch.set_num_threads(1)
        self.device = _device(backend)
        self.module = nn.Module()
        for n, t in _tensors(shapes, getattr(torch, dtype), seed=None, device=self.device).items():
            self.module.register_parameter(n.replace(".", "__"), nn.Parameter(t, requires_grad=False))
        self.receiver = WeightReceiver()
        self.raw: Any = None
        self.raw_buffer: Any = None

    def _load(self, snapshot: Any) -> int:
        from single_controller.backends.common.weights import WeightManifest, WeightSnapshot, load_snapshot

        m = snapshot.manifest
        entries = tuple(dataclasses.replace(e, name=e.name.replace(".", "__")) for e in m.entries)
        renamed = WeightManifest(m.version, m.dtype, entries, m.bucket_numels)
        load_snapshot(self.module, WeightSnapshot(renamed, snapshot.buckets))
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        return m.version

    async def update_weights(self, handle: Any) -> int:
        from single_controller.backends.common.weights import resolve_snapshot

        return self._load(await resolve_snapshot(handle.payload))

    async def sync_ranks(self) -> int:
        return 1

    async def join_sync_group(self, addr: Any) -> None:
        await asyncio.to_thread(self.receiver.join, addr, 1)

    async def receive_weights(self, handle: Any, key: str) -> int:
        snap = await asyncio.to_thread(self.receiver.receive, key, handle.payload.manifest)
        return self._load(snap)

    def matches(self, expected: dict[str, Any]) -> bool:
        import torch

        held = dict(self.module.named_parameters())
        return all(torch.equal(held[n.replace(".", "__")].cpu(), t.cpu()) for n, t in expected.items())

    async def raw_join(self, addr: Any, rank: int) -> None:
        from single_controller.backends.common.weight_broadcast import open_group

        self.raw = await asyncio.to_thread(open_group, addr, rank)

    async def raw_receive(self, nbytes: int) -> None:
        import torch

        from single_controller.backends.common.weight_broadcast import broadcast_one

        if self.raw_buffer is None or len(self.raw_buffer) != nbytes:
            self.raw_buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        await asyncio.to_thread(broadcast_one, self.raw, self.raw_buffer)


async def _one_sync(sender: Any, clients: Sequence[Any], version: int, transport: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    handle = await sender.export.remote(version, transport)
    t1 = time.perf_counter()
    await asyncio.gather(*(c.update_weights(handle) for c in clients))
    return t1 - t0, time.perf_counter() - t1


async def _raw(sender: Any, receivers: Sequence[Any], nbytes: int, args: argparse.Namespace) -> float:
    from single_controller.backends.common.weight_broadcast import GroupAddress

    host, port = await sender.sync_address.remote()
    addr = GroupAddress(f"raw-{uuid.uuid4().hex[:8]}", host, port, 1 + len(receivers), args.backend, args.timeout_s)
    await asyncio.gather(
        sender.raw_open.remote(addr), *(r.raw_join.remote(addr, i + 1) for i, r in enumerate(receivers))
    )
    times = []
    for _ in range(args.repeats + 1):  # the first one connects
        got = await asyncio.gather(
            sender.raw_broadcast.remote(nbytes), *(r.raw_receive.remote(nbytes) for r in receivers)
        )
        times.append(got[0])
    return statistics.median(times[1:])


WARMUP = 3  # = weight_broadcast.STAGED_VERSIONS


def _spawn(shapes: Any, workers: int, args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """A fresh sender and `workers` receivers (NCCL: each on a GPU of its own)."""
    import ray

    from single_controller.backends.common.rank_calls import RANK_CONCURRENCY

    send_cls = ray.remote(concurrency_groups=RANK_CONCURRENCY)(BenchSender)  # type: ignore[call-overload]
    res = {"num_cpus": 0, "num_gpus": 1 if args.backend == "nccl" else 0}
    sender = send_cls.options(**res).remote(shapes, args.dtype, args.bucket_mb, args.backend)
    recv_cls: Any = ray.remote(BenchReceiver)
    return sender, [recv_cls.options(**res).remote(shapes, args.dtype, args.backend) for _ in range(workers)]


async def _transport_row(shapes: Any, workers: int, transport: str, args: argparse.Namespace) -> dict[str, Any]:
    """One transport's median sync, in processes of its own (what one transport left in memory, the
    object store's pages or the staged snapshots, does not weigh on the other's figures)."""
    import ray

    from single_controller.backends.common.actor_client import ActorGenerationClient
    from single_controller.backends.common.weight_broadcast import SyncLink

    sender, receivers = _spawn(shapes, workers, args)
    try:
        expected = await sender.expected.remote()
        link = SyncLink(args.backend, args.timeout_s)
        clients = [ActorGenerationClient(f"bench{i}", r, sync=link) for i, r in enumerate(receivers)]
        # Warm-up: forms the groups, and fills the sender's staged versions (from then on each sync
        # packs into the buckets of the one it drops, as in a long run).
        for v in range(WARMUP):
            await _one_sync(sender, clients, v, transport)
        times = [await _one_sync(sender, clients, WARMUP + v, transport) for v in range(args.repeats)]
        if not all(await asyncio.gather(*(r.matches.remote(expected) for r in receivers))):
            raise AssertionError(f"{transport}: a receiver does not hold the sender's weights")
        if any(c.sync_fallback for c in clients):
            raise AssertionError(f"{transport}: fell back to the object store: {clients[0].sync_fallback}")
        publish = statistics.median(t[0] for t in times)
        deliver = statistics.median(t[1] for t in times)
        return dict(transport=transport, publish_s=publish, deliver_s=deliver, sync_s=publish + deliver)
    finally:
        for a in [sender, *receivers]:
            ray.kill(a)


async def bench_point(num_params: int, workers: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every transport for one model size and worker count, one row each, then the raw broadcast and
    the memcpy of the same bytes (fresh processes for each)."""
    import ray

    shapes = model_shapes(num_params)
    n = sum(math.prod(s) for _, s in shapes)
    rows = [await _transport_row(shapes, workers, t, args) for t in args.transports]
    nbytes = n * (2 if args.dtype in ("bfloat16", "float16") else 4)
    sender, receivers = _spawn(model_shapes(0)[:1], workers, args)  # the raw moves bytes, not a model
    try:
        raw = await _raw(sender, receivers, nbytes, args)
        memcpy = await sender.memcpy.remote(nbytes)
    finally:
        for a in [sender, *receivers]:
            ray.kill(a)
    for r in rows:
        r.update(
            params=n,
            workers=workers,
            bytes=nbytes,
            gbps=nbytes * workers / r["sync_s"] / 1e9,
            raw_bcast_s=raw,
            memcpy_s=memcpy,
            x_raw=r["deliver_s"] / raw,
        )
    return rows


def _print(rows: Sequence[dict[str, Any]], title: str) -> None:
    print(title)
    head = f"{'params':>7} {'workers':>7} {'transport':<12} {'MB':>7} {'publish_s':>9} {'deliver_s':>9} {'sync_s':>8}"
    head += f" {'GB/s':>6} {'raw_bcast_s':>11} {'memcpy_s':>8} {'x raw':>6}"
    print(head)
    for r in rows:
        print(
            f"{r['params'] / 1e6:>6.0f}M {r['workers']:>7} {r['transport']:<12} {r['bytes'] / 1e6:>7.0f} "
            f"{r['publish_s']:>9.3f} {r['deliver_s']:>9.3f} {r['sync_s']:>8.3f} {r['gbps']:>6.2f} "
            f"{r['raw_bcast_s']:>11.3f} {r['memcpy_s']:>8.3f} {r['x_raw']:>6.2f}"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sc-grpo bench sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", nargs="+", default=["10M", "100M", "500M"], help="model sizes: 10M 100M 500M or a count")
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2], help="generation worker counts")
    p.add_argument("--transports", nargs="+", default=["object_store", "collective"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: every process on a GPU of its own"
    )
    p.add_argument("--bucket-mb", type=float, default=64.0, help="snapshot bucket size (sync.weight_bucket_mb)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per point (after one warm-up)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    bad = [t for t in args.transports if t not in ("object_store", "collective")]
    if bad:
        p.error(f"unknown transport(s) {bad}: object_store, collective")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import json
    import os

    args = parse_args(argv)
    import ray

    own = not ray.is_initialized()
    if own:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
        }
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    rows: list[dict[str, Any]] = []
    try:
        for size in args.params:
            num = parse_size(size)
            for w in args.workers:
                rows += asyncio.run(bench_point(num, w, args))
    finally:
        if own:
            ray.shutdown()
    _print(
        rows,
        f"weight sync over {args.backend}, {args.dtype}, buckets of {args.bucket_mb:g} MiB, median of {args.repeats}",
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
