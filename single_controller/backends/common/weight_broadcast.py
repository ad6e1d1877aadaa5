"""Weight sync over a collective group (`sync.transport: collective`).

Instead of copying the packed snapshot into Ray's object store, the trainer's rank 0 keeps the
buckets (`WeightSender.stage_weights`) and broadcasts them over a `torch.distributed` group made per
generation worker (gloo on CPU, NCCL on GPUs); the worker loads them as it loads an object-store
snapshot. Groups meet at a `TCPStore` the sender hosts (`sync_address`), under
`timeouts.weight_sync_s`. Nothing is allocated per sync in steady state: the sender packs into the
buckets of a dropped staged version (`make_room`), a receiver into its last snapshot's. A group that
cannot be formed falls back, once and saying so, to an object-store snapshot (`put_weights`).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from single_controller.backends.common.rank_calls import node_ip
from single_controller.backends.common.weights import WeightManifest, WeightSnapshot, bucket_tensor, to_bucket

# Staged versions a sender keeps: the weights channel holds one handle (capacity 1), so at most three
# are alive: the one being synced, the one queued behind it, and the one the train pump exported
# while it waits for the channel (a restarted worker asks for the newest the sync pump took).
STAGED_VERSIONS = 3


class SyncGroupError(RuntimeError):
    """A weight-sync group could not be formed or used; the message names the group and what failed."""


@dataclass(frozen=True)
class GroupAddress:
    key: str  # the group's name, unique per (sender, worker incarnation)
    host: str  # the sender's node
    port: int  # its TCPStore
    world_size: int  # 1 (the sender) + the worker's receiving processes
    backend: str  # "gloo" | "nccl"
    timeout_s: float


@dataclass(frozen=True)
class StagedWeights:
    """`WeightsHandle.payload` of the collective transport: the bytes stay with `sender` (a trainer
    rank actor with `WeightSender`) until it broadcasts them to a worker's group."""

    manifest: WeightManifest
    sender: Any


@dataclass(frozen=True)
class SyncLink:
    """How a generation worker's client forms its group: the collective backend and every wait's deadline."""

    backend: str = "gloo"
    timeout_s: float = 120.0


def sync_link(trainer_device: str, generation_device: str, timeout_s: float, same_gpu: bool = False) -> SyncLink:
    """NCCL when both ends hold their weights on CUDA, on GPUs of their own; else gloo (staged buckets
    live on the host): NCCL refuses two ranks on one GPU (colocated), which then go through the host."""
    both_cuda = trainer_device == "cuda" and generation_device == "cuda" and not same_gpu
    return SyncLink("nccl" if both_cuda else "gloo", timeout_s)


def _timeout(addr: GroupAddress) -> datetime.timedelta:
    return datetime.timedelta(seconds=addr.timeout_s)


def open_group(addr: GroupAddress, rank: int, store: Any | None = None) -> Any:
    """This process's member of the group at `addr` (rank 0 passes its own `store`); blocks until
    every member has joined, at most the group's timeout."""
    if store is None:
        store = dist.TCPStore(addr.host, addr.port, None, False, timeout=_timeout(addr))
    prefixed = dist.PrefixStore(f"sc-grpo/{addr.key}", store)
    try:
        if addr.backend == "nccl":  # CUDA builds of torch only
            nccl = dist.ProcessGroupNCCL
            opts = nccl.Options()
            opts._timeout = _timeout(addr)
            return nccl(prefixed, rank, addr.world_size, opts)
        return dist.ProcessGroupGloo(prefixed, rank, addr.world_size, _timeout(addr))
    except Exception as e:
        raise SyncGroupError(
            f"weight-sync group {addr.key} ({addr.backend}, {addr.world_size} ranks at {addr.host}:{addr.port}): "
            f"rank {rank} could not join within {addr.timeout_s:g} s: {e}"
        ) from e


def broadcast_one(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast one tensor from rank 0 (in place on the others)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([tensor], opts).wait()


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def broadcast_buckets(group: Any, buckets: Sequence[torch.Tensor], backend: str = "gloo") -> int:
    """Rank 0: send every bucket, in order; returns the bytes sent."""
    device = _device(backend)
    sent = 0
    for b in buckets:
        broadcast_one(group, b if b.device == device else b.to(device, non_blocking=False))
        sent += b.numel() * b.element_size()
    return sent


def bucket_buffers(manifest: WeightManifest, backend: str) -> list[torch.Tensor]:
    """Empty buckets to receive `manifest` into: flat tensors of its dtype on the group's device."""
    dtype, device = getattr(torch, manifest.dtype), _device(backend)
    return [torch.empty(n, dtype=dtype, device=device) for n in manifest.bucket_numels]


def receive_snapshot(
    group: Any, manifest: WeightManifest, backend: str = "gloo", into: Sequence[torch.Tensor] | None = None
) -> WeightSnapshot:
    """Ranks 1..: the whole snapshot, received into `into` (`bucket_buffers` of the same layout) or new
    buckets, ready for `weights.load_snapshot` (or the vLLM extension's `sc_load_snapshot`)."""
    buckets = list(into) if into is not None else bucket_buffers(manifest, backend)
    for t in buckets:
        broadcast_one(group, t)
    return WeightSnapshot(manifest, buckets)


class WeightSender:
    """Mixed into a trainer rank actor: stages snapshots and broadcasts them to worker groups.
    `stage_weights` runs on the actor's main thread (the export after a finish); the other methods
    on `rank_calls.SYNC_GROUP` threads (`ray.remote(concurrency_groups=...)`): they only read staged buckets."""

    _sync_lock: threading.Lock
    _staged: dict[int, tuple[WeightManifest, list[torch.Tensor]]]
    _sync_groups: dict[str, tuple[GroupAddress, Any]]
    _sync_store: Any
    _sending: dict[int, int]  # version -> readers of its buckets now (sends, object-store copies)

    def _sender_state(self) -> None:
        if not hasattr(self, "_sync_lock"):
            self._sync_lock = threading.Lock()
            self._staged, self._sync_groups, self._sync_store = {}, {}, None
            self._sending = {}  # version -> readers of its buckets now (`_reading`)

    def make_room(self) -> list[torch.Tensor] | None:
        """Before packing a new version: drop all but the newest `STAGED_VERSIONS - 1`; returns the
        buckets of one dropped that no send is reading, to pack the new version into (`pack_weights(into=)`:
        the peak stays `STAGED_VERSIONS` snapshots, and no new memory is faulted in per sync)."""
        self._sender_state()
        spare = None
        with self._sync_lock:
            for old in sorted(self._staged)[: -(STAGED_VERSIONS - 1)]:
                _, buckets = self._staged.pop(old)
                if not self._sending.get(old):
                    spare = buckets
        return spare

    def stage_weights(self, snapshot: WeightSnapshot, sender: Any) -> StagedWeights:
        """Keep `snapshot`'s (in-process) buckets for broadcasting; the newest `STAGED_VERSIONS` are kept
        (call `make_room` before packing it)."""
        self._sender_state()
        m = snapshot.manifest
        buckets = [bucket_tensor(b, m.dtype) for b in snapshot.buckets]
        with self._sync_lock:
            self._staged[m.version] = (m, buckets)
            for old in sorted(self._staged)[:-STAGED_VERSIONS]:
                del self._staged[old]
        return StagedWeights(m, sender)

    @contextlib.contextmanager
    def _reading(self, version: int) -> Iterator[tuple[WeightManifest, list[torch.Tensor]]]:
        """Staged `version`, its buckets marked as read until the block ends: found and marked under
        one hold of the lock, so `make_room` (an export, on the actor's main thread) never packs a
        new version into them meanwhile."""
        self._sender_state()
        with self._sync_lock:
            staged = self._staged.get(version)
            if staged is None:
                raise SyncGroupError(
                    f"weights v{version} are not staged here any more (staged: {sorted(self._staged)}; "
                    f"a sender keeps the newest {STAGED_VERSIONS})"
                )
            self._sending[version] = self._sending.get(version, 0) + 1
        try:
            yield staged
        finally:
            with self._sync_lock:
                self._sending[version] -= 1
                if not self._sending[version]:
                    del self._sending[version]

    def sync_address(self) -> tuple[str, int]:
        """(the IP this node registered with the cluster, the port of the TCPStore every group of this
        sender meets at; see `rank_calls.node_ip`)."""
        self._sender_state()
        with self._sync_lock:
            if self._sync_store is None:
                self._sync_store = dist.TCPStore(
                    "0.0.0.0", 0, None, True, timeout=datetime.timedelta(seconds=600), wait_for_workers=False
                )
            return node_ip(), int(self._sync_store.port)

    def open_sync_group(self, addr: GroupAddress) -> None:
        """Rank 0 of a new group (the worker's ranks join at the same time)."""
        self.sync_address()  # the store exists
        group = open_group(addr, 0, store=self._sync_store)
        with self._sync_lock:
            self._sync_groups[addr.key] = (addr, group)

    def send_weights(self, key: str, version: int) -> int:
        """Broadcast staged `version` to group `key`; returns the bytes sent. A failed send drops the
        group (the client forms a new one)."""
        with self._reading(version) as (_, buckets):
            with self._sync_lock:
                entry = self._sync_groups.get(key)
            if entry is None:
                raise SyncGroupError(f"no weight-sync group {key} on this sender (closed, or never formed)")
            addr, group = entry
            try:
                return broadcast_buckets(group, buckets, addr.backend)
            except Exception as e:
                self.close_sync_group(key)
                raise SyncGroupError(f"weight-sync group {key}: broadcasting v{version} failed: {e}") from e

    def put_weights(self, version: int) -> WeightSnapshot:
        """The object-store fallback: staged `version` as `ray.put` buckets."""
        import ray

        with self._reading(version) as (m, buckets):  # `ray.put` copies from the staged buckets
            return WeightSnapshot(m, [ray.put(to_bucket(b)) for b in buckets])

    def close_sync_group(self, key: str) -> bool:
        """Forget group `key` (a restarted or removed worker's); True if it existed."""
        self._sender_state()
        with self._sync_lock:
            return self._sync_groups.pop(key, None) is not None


class WeightReceiver:
    """A generation worker's end of its weight-sync group (one group at a time), held by the torch and
    the vLLM generation actors (vLLM's engine runs in the actor's process: `distributed_executor_backend="uni"`)."""

    def __init__(self) -> None:
        self._group: tuple[GroupAddress, Any] | None = None
        # The buckets of the last snapshot, received into again while the layout stays the same:
        # a fresh buffer would be faulted in page by page on every sync (on a VM that can cost more
        # than the transfer: docs/performance.md). Costs one snapshot's bytes between syncs.
        self._buffers: tuple[tuple[str, tuple[int, ...], str], list[torch.Tensor]] | None = None
        self._lock = threading.Lock()  # one receive at a time: the buffers are reused

    def join(self, addr: GroupAddress, rank: int) -> None:
        """Join the group at `addr` as `rank` (blocks until all have joined); leaves the previous one."""
        self._group = None
        self._group = (addr, open_group(addr, rank))

    def _current(self, key: str) -> tuple[GroupAddress, Any]:
        if self._group is None or self._group[0].key != key:
            have = self._group[0].key if self._group is not None else "none"
            raise SyncGroupError(f"this worker is not in weight-sync group {key} (it is in: {have})")
        return self._group

    def receive(self, key: str, manifest: WeightManifest) -> WeightSnapshot:
        """The whole snapshot (`receive_snapshot`); a failure leaves the group (the client forms a new one)."""
        addr, group = self._current(key)
        layout = (manifest.dtype, tuple(manifest.bucket_numels), addr.backend)
        try:
            with self._lock:
                if self._buffers is None or self._buffers[0] != layout:
                    self._buffers = None  # the old layout's memory goes before the new is taken
                    self._buffers = (layout, bucket_buffers(manifest, addr.backend))
                return receive_snapshot(group, manifest, addr.backend, into=self._buffers[1])
        except Exception as e:
            self._group = None
            raise SyncGroupError(f"weight-sync group {key}: receiving v{manifest.version} failed: {e}") from e
