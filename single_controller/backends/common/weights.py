"""Weight snapshots: how weights travel from a trainer backend to a generation backend.

A `WeightSnapshot` is the tensors packed into flat numpy buckets of at most `bucket_bytes` plus a
`WeightManifest` (names, shapes, offsets, the policy version). Names are the checkpoint's, so any
trainer feeds any generation backend. `pack_weights` is the one packer (cast to the generation
dtype on the way; bfloat16 travels as its int16 bit pattern, `CARRIERS`); `resolve_snapshot` awaits
the buckets' ObjectRefs; `load_snapshot` checks the whole manifest, then copies into a module.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class WeightEntry:
    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # in elements, within the bucket
    numel: int


@dataclass(frozen=True)
class WeightManifest:
    version: int
    dtype: str  # torch dtype name of every tensor, e.g. "float32", "bfloat16" (buckets: `carrier`)
    entries: tuple[WeightEntry, ...]
    bucket_numels: tuple[int, ...]

    @property
    def carrier(self) -> str:
        """The numpy dtype name of the buckets (int16 for bfloat16: numpy has no bfloat16)."""
        return CARRIERS.get(self.dtype, self.dtype)

    @property
    def num_bytes(self) -> int:
        return sum(self.bucket_numels) * np.dtype(self.carrier).itemsize


# torch dtypes numpy lacks -> the numpy dtype of the same width that carries their bits
CARRIERS = {"bfloat16": "int16"}


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight manifest names dtype {name!r}, which is not a torch dtype")
    return dtype


def to_bucket(flat: torch.Tensor) -> np.ndarray:
    """A flat CPU tensor as a numpy array (a bfloat16 one as its int16 bits)."""
    carrier = CARRIERS.get(str(flat.dtype).removeprefix("torch."))
    return (flat if carrier is None else flat.view(getattr(torch, carrier))).numpy()


def bucket_tensor(bucket: Any, dtype: str) -> torch.Tensor:
    """A numpy bucket as a torch tensor of torch dtype `dtype` (no copy; reinterprets a carrier). A
    torch bucket (received over a weight-sync group) is already one."""
    if isinstance(bucket, torch.Tensor):
        return bucket
    with warnings.catch_warnings():
        # Buckets read from Ray's object store are read-only; they are only copied from.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(np.asarray(bucket))
    return t.view(_torch_dtype(dtype)) if dtype in CARRIERS else t


@dataclass(frozen=True)
class WeightSnapshot:
    """`buckets[i]` is a 1-D numpy array, or (Ray) an ObjectRef of one, resolved by `resolve_snapshot`."""

    manifest: WeightManifest
    buckets: Sequence[Any]


def _named(tensors: nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return list(tensors.named_parameters() if isinstance(tensors, nn.Module) else tensors.items())


def bucket_groups(
    named: Iterable[tuple[str, torch.Tensor]], itemsize: int, bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors, grouped into buckets of at most `bucket_bytes` at `itemsize` bytes an
    element (a larger tensor alone); a sharded tensor counts its whole size (`numel()` of a DTensor)."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    filled = 0
    for name, t in named:
        if groups[-1] and (filled + t.numel()) * itemsize > bucket_bytes:
            groups.append([])
            filled = 0
        groups[-1].append((name, t))
        filled += t.numel()
    return groups


class SnapshotBuilder:
    """A snapshot packed one bucket at a time (`pack_weights` packs all; a sharded trainer gathers
    and packs bucket by bucket, so no rank ever holds more than one bucket of the whole policy).
    `dtype`: the buckets' torch dtype."""

    def __init__(self, version: int, dtype: torch.dtype):
        self.version, self.dtype = version, dtype
        self.entries: list[WeightEntry] = []
        self.bucket_numels: list[int] = []

    def add(
        self,
        group: Sequence[tuple[str, torch.Tensor]],
        prefix: str = "",
        into: torch.Tensor | None = None,
        whole: Iterable[tuple[str, torch.Tensor]] | None = None,
        fresh: bool = False,
    ) -> Any:
        """Pack `group` (named tensors) as the next bucket, each tensor cast while it is copied into
        its slice (no full-width copy first); returns the bucket (`to_bucket`). `into`: a flat tensor
        no one reads any more, packed into when its size and dtype fit (new memory is slow to fault in).
        `whole`: what is copied, `group`'s tensors whole and in order, taken one at a time (a sharded
        policy's, gathered as they are asked for); default: `group`'s own. `fresh`: those are copies no
        one else holds, so a tensor alone in its bucket, already of its dtype on the host, is the bucket."""
        b, numel = len(self.bucket_numels), sum(t.numel() for _, t in group)
        source = iter(group if whole is None else whole)
        if fresh and len(group) == 1 and into is None:
            t = next(source)[1]
            if (t.dtype, t.device.type) == (self.dtype, "cpu") and t.is_contiguous():
                self.entries.append(WeightEntry(prefix + group[0][0], tuple(t.shape), b, 0, t.numel()))
                self.bucket_numels.append(numel)
                return to_bucket(t.detach().reshape(-1))
            source = iter([(group[0][0], t)])
        flat = into
        if flat is None or (flat.numel(), flat.dtype, flat.device.type) != (numel, self.dtype, "cpu"):
            flat = torch.empty(numel, dtype=self.dtype)
        offset = 0
        with torch.no_grad():
            for name, _ in group:
                t = next(source)[1]  # not zip: it would hold the previous tensor while the next is made
                self.entries.append(WeightEntry(prefix + name, tuple(t.shape), b, offset, t.numel()))
                flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
                offset += t.numel()
                del t
        self.bucket_numels.append(numel)
        return to_bucket(flat)

    def manifest(self) -> WeightManifest:
        return WeightManifest(
            version=self.version,
            dtype=str(self.dtype).removeprefix("torch."),
            entries=tuple(self.entries),
            bucket_numels=tuple(self.bucket_numels),
        )


def pack_weights(
    tensors: nn.Module | Mapping[str, torch.Tensor],
    version: int,
    bucket_bytes: int = 4 << 20,
    prefix: str = "",
    dtype: torch.dtype | None = None,
    into: Sequence[torch.Tensor] | None = None,
) -> WeightSnapshot:
    """Copy a module's parameters (or named tensors, all of one dtype) into flat buckets of `dtype`
    (None: theirs); every name is prefixed with `prefix`. `into`: buckets of an earlier snapshot no
    one reads any more, packed into where their size and dtype fit (new memory is slow to fault in)."""
    named = _named(tensors)
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) != 1:
        raise ValueError(f"tensors mix dtypes {sorted(map(str, dtypes))}; one dtype per snapshot")
    builder = SnapshotBuilder(version, dtype or named[0][1].dtype)
    buckets = []
    for b, group in enumerate(bucket_groups(named, builder.dtype.itemsize, bucket_bytes)):
        buckets.append(builder.add(group, prefix, into[b] if into is not None and b < len(into) else None))
    return WeightSnapshot(builder.manifest(), buckets)


async def resolve_snapshot(snapshot: WeightSnapshot) -> WeightSnapshot:
    """Await bucket ObjectRefs (Ray), leaving in-process numpy buckets as they are."""
    buckets = [await b if inspect.isawaitable(b) else b for b in snapshot.buckets]
    return WeightSnapshot(snapshot.manifest, buckets)


def _problems(params: Mapping[str, torch.Tensor], snapshot: WeightSnapshot) -> list[str]:
    """Everything about `snapshot` that does not fit parameters `params` (empty: it fits)."""
    m = snapshot.manifest
    problems = []
    if set(params) != {e.name for e in m.entries}:
        missing = sorted(set(params) - {e.name for e in m.entries})
        extra = sorted({e.name for e in m.entries} - set(params))
        problems.append(f"parameter names differ (missing {missing[:5]}, unexpected {extra[:5]})")
    if len(snapshot.buckets) != len(m.bucket_numels):
        problems.append(f"{len(snapshot.buckets)} buckets for a manifest of {len(m.bucket_numels)}")
    else:
        for i, (b, n) in enumerate(zip(snapshot.buckets, m.bucket_numels)):
            # numpy buckets carry `m.carrier`, torch ones (a broadcast's) the manifest's own dtype
            expect = f"torch.{m.dtype}" if isinstance(b, torch.Tensor) else m.carrier
            if b.ndim != 1 or len(b) != n or str(b.dtype) != expect:
                problems.append(f"bucket {i} is {b.dtype}{list(b.shape)}, manifest says {expect}[{n}] ({m.dtype})")
    for e in m.entries:
        p = params.get(e.name)
        if p is not None and tuple(p.shape) != e.shape:
            problems.append(f"{e.name}: shape {tuple(p.shape)} != snapshot {e.shape}")
    return problems


def load_snapshot(module: nn.Module, snapshot: WeightSnapshot) -> None:
    """Copy a snapshot into `module`'s parameters; validates names, shapes and sizes first."""
    m = snapshot.manifest
    params = dict(module.named_parameters())
    problems = _problems(params, snapshot)
    if problems:
        raise ValueError(f"weight snapshot v{m.version} does not fit the model: " + "; ".join(problems))
    with torch.no_grad():
        for e in m.entries:
            src = bucket_tensor(snapshot.buckets[e.bucket], m.dtype)[e.offset : e.offset + e.numel]
            params[e.name].copy_(src.view(e.shape))  # casts to the module's dtype
