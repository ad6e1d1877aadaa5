"""Trainer-side reads: rows go from row storage straight to the rank that trains them (one hop).

`fetch_rows` reads through the storage's sync twin and validates the result again (a trainer never
trains on a short batch). `fetch_and_broadcast` is the model-parallel hook: only `src_rank` reads,
then broadcasts the rows to its group; if its read fails, every other rank raises
`StorageReadError` quoting it, so no rank is left waiting in a collective. Both return what
`RowStorage.get_rows` returns, rows in the order of `keys`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from replay.storage import ROLLOUT_SCHEMA, Column, FieldSpec, StorageReadError, validate_read


class SyncRowReader(Protocol):
    """What a trainer rank needs from row storage (`TQRowStorage`, `InMemoryRowStorage`)."""

    schema: Mapping[str, FieldSpec]

    def get_rows_sync(self, keys: Sequence[str], fields: Sequence[str]) -> dict[str, Column]: ...


def fetch_rows(storage: SyncRowReader, keys: Sequence[str], fields: Sequence[str]) -> dict[str, Column]:
    unknown = [f for f in fields if f not in storage.schema]
    if unknown:
        raise StorageReadError(f"unknown fields {unknown} (schema: {sorted(storage.schema)})")
    got = storage.get_rows_sync(keys, fields)
    validate_read(storage.schema, keys, fields, got, len(keys))  # per-field row counts and dtypes
    return {f: got[f] for f in fields}


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype


def fetch_and_broadcast(
    storage: SyncRowReader | None,
    keys: Sequence[str],
    fields: Sequence[str],
    group: Any,
    src_rank: int,
    *,
    schema: Mapping[str, FieldSpec] | None = None,
) -> dict[str, Column]:
    """Read on `src_rank` only and broadcast to `group` (None: the default group).

    Ranks other than `src_rank` may pass `storage=None`; they then need `schema` (default: the
    storage's, else `ROLLOUT_SCHEMA`) to know each field's dtype and shape.
    """
    import torch.distributed as dist

    schema = dict(schema if schema is not None else storage.schema if storage is not None else ROLLOUT_SCHEMA)
    unknown = [f for f in fields if f not in schema]
    if unknown:
        raise StorageReadError(f"unknown fields {unknown} (schema: {sorted(schema)})")
    n = len(keys)
    jagged = [f for f in fields if schema[f].jagged]
    is_src = dist.get_rank() == src_rank
    got: dict[str, Column] = {}
    error: Exception | None = None
    if is_src:
        if storage is None:
            raise ValueError(f"rank {src_rank} is the source and needs a storage")
        try:
            got = fetch_rows(storage, keys, fields)
        except Exception as e:  # incl. a storage deadline: siblings must not wait in the broadcast
            error = e
    header = (
        _header(got, jagged, n, failed=error is not None)
        if is_src
        else torch.zeros(1 + len(jagged) * n, dtype=torch.int64)
    )
    dist.broadcast(header, src=src_rank, group=group)
    if header[0].item() != 0:
        _raise_source_error(error, n, group, src_rank)
    lengths = {f: header[1 + j * n : 1 + (j + 1) * n] for j, f in enumerate(jagged)}  # [B] each
    numels = {f: int(lengths[f].sum()) if schema[f].jagged else n for f in fields}
    nbytes = {f: numels[f] * torch.empty(0, dtype=_wire_dtype(schema[f].dtype)).element_size() for f in fields}
    payload = _pack(got, fields, schema, nbytes) if is_src else torch.empty(sum(nbytes.values()), dtype=torch.uint8)
    if payload.numel():
        dist.broadcast(payload, src=src_rank, group=group)
    return got if is_src else _unpack(payload, fields, schema, nbytes, lengths)


def _header(got: Mapping[str, Column], jagged: Sequence[str], n: int, *, failed: bool) -> torch.Tensor:
    """[status, lengths of every jagged field's rows...]  # [1 + len(jagged) * B]"""
    header = torch.zeros(1 + len(jagged) * n, dtype=torch.int64)
    if failed:
        header[0] = 1
        return header
    for j, f in enumerate(jagged):
        header[1 + j * n : 1 + (j + 1) * n] = torch.tensor([t.numel() for t in got[f]], dtype=torch.int64)
    return header


def _raise_source_error(error: Exception | None, n: int, group: Any, src_rank: int) -> None:
    """The source's read failed: it re-raises its own error; every other rank raises one quoting it."""
    import torch.distributed as dist

    message = [str(error) if error is not None else None]
    dist.broadcast_object_list(message, src=src_rank, group=group)
    if error is not None:
        raise error
    raise StorageReadError(f"rank {src_rank} could not read the {n} rows to broadcast: {message[0]}")


def _pack(
    got: Mapping[str, Column], fields: Sequence[str], schema: Mapping[str, FieldSpec], nbytes: Mapping[str, int]
) -> torch.Tensor:
    """Every field's bytes in one buffer, in `fields` order."""
    payload = torch.empty(sum(nbytes.values()), dtype=torch.uint8)
    offset = 0
    for f in fields:
        if nbytes[f]:  # (torch.cat of no rows would raise)
            col = got[f]
            if schema[f].jagged:
                flat = torch.cat(list(col))
            else:
                assert isinstance(col, torch.Tensor), f"scalar field {f} is one tensor [B] (validate_read)"
                flat = col
            payload[offset : offset + nbytes[f]] = flat.to(_wire_dtype(schema[f].dtype)).contiguous().view(torch.uint8)
        offset += nbytes[f]
    return payload


def _unpack(
    payload: torch.Tensor,
    fields: Sequence[str],
    schema: Mapping[str, FieldSpec],
    nbytes: Mapping[str, int],
    lengths: Mapping[str, torch.Tensor],
) -> dict[str, Column]:
    out: dict[str, Column] = {}
    offset = 0
    for f in fields:
        spec = schema[f]
        # clone: a fresh, aligned buffer before reinterpreting the bytes
        flat = payload[offset : offset + nbytes[f]].clone().view(_wire_dtype(spec.dtype)).to(spec.dtype)
        offset += nbytes[f]
        out[f] = list(torch.split(flat, lengths[f].tolist())) if spec.jagged else flat
    return out


class RowPrefetcher:
    """Trainer-side read-ahead: `prefetch(keys, fields)` starts reading rows on a background thread;
    `fetch(keys, fields)` returns them (waiting for a read in progress), reading whatever was not
    prefetched directly. Rows are immutable once they are ready for training, so a prefetched row is
    exactly what a fresh read returns. A failed prefetch is forgotten and the rows are read again (so
    the error, if real, surfaces from `fetch`). Entries not consumed within `keep_batches` later
    prefetches are dropped, bounding memory when a hinted group is never trained here.

    Thread-safe: a rank actor takes `prefetch` on its own thread (`rank_calls.PREFETCH_GROUP`), so a
    hint starts the read while a microbatch is computing instead of queueing behind it.
    """

    def __init__(self, storage: SyncRowReader, keep_batches: int = 8):
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.storage = storage
        self._lock = threading.Lock()  # guards _entries, _batch and the counts
        self.keep_batches = keep_batches
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._entries: dict[str, tuple[int, Any, int, tuple[str, ...]]] = {}  # key -> (batch, future, index, fields)
        self._batch = 0
        self.hits = self.misses = 0

    def take_hit_rate(self) -> float:
        """The share of fetches served by a prefetch since the last call (0 when none); resets the counts."""
        with self._lock:
            rate = self.hits / max(1, self.hits + self.misses)
            self.hits = self.misses = 0
        return rate

    def prefetch(self, keys: Sequence[str], fields: Sequence[str]) -> None:
        with self._lock:
            keys = [k for k in keys if k not in self._entries]
            if not keys:
                return
            self._batch += 1
            fut = self._pool.submit(fetch_rows, self.storage, list(keys), list(fields))
            for i, k in enumerate(keys):
                self._entries[k] = (self._batch, fut, i, tuple(fields))
            stale = [k for k, (b, *_rest) in self._entries.items() if b <= self._batch - self.keep_batches]
            for k in stale:
                del self._entries[k]

    def fetch(self, keys: Sequence[str], fields: Sequence[str]) -> dict[str, Column]:
        rows: dict[str, dict[str, Any]] = {}
        with self._lock:
            entries = [(k, self._entries.pop(k, None)) for k in keys]
        whole = self._whole_read(entries, fields)
        if whole is not None:  # the common case: exactly one prefetch's keys, in its order
            with self._lock:
                self.hits += len(keys)
            return whole
        for k, entry in entries:
            if entry is None or not set(fields) <= set(entry[3]):
                continue
            _, fut, i, _ = entry
            try:
                got = fut.result()
            except Exception:
                continue  # read again below; a real error will surface there
            rows[k] = {f: got[f][i] for f in fields}
        missing = [k for k in keys if k not in rows]
        with self._lock:
            self.hits += len(rows)
            self.misses += len(missing)
        if missing:
            got = fetch_rows(self.storage, missing, fields)
            for i, k in enumerate(missing):
                rows[k] = {f: got[f][i] for f in fields}
        schema = self.storage.schema
        return {
            f: [rows[k][f] for k in keys] if schema[f].jagged else torch.stack([rows[k][f] for k in keys])
            for f in fields
        }

    @staticmethod
    def _whole_read(entries: list[tuple[str, Any]], fields: Sequence[str]) -> dict[str, Column] | None:
        """The columns of one successful prefetch when `entries` are all of its rows, in its order,
        with every field asked for; else None (the caller assembles the rows one by one)."""
        if not entries or entries[0][1] is None:
            return None
        fut = entries[0][1][1]
        for i, (_, entry) in enumerate(entries):
            if entry is None or entry[1] is not fut or entry[2] != i:
                return None
        if not set(fields) <= set(entries[0][1][3]):
            return None
        try:
            got = fut.result()
        except Exception:
            return None  # read again by the caller; a real error will surface there
        if any(len(got[f]) != len(entries) for f in fields):
            return None  # the prefetch read more rows than these
        return {f: got[f] for f in fields}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._entries.clear()


def with_advantages(rows: Mapping[str, Any], advantages: Sequence[float] | None) -> Mapping[str, Any]:
    """`rows` plus the `advantage` column a train chunk carried (one float per row, in row order);
    unchanged when it carried none (the column was read with the rows)."""
    if advantages is None:
        return rows
    n = len(rows["prompt_ids"])
    if len(advantages) != n:
        raise ValueError(f"{len(advantages)} advantages for {n} rows")
    return {**rows, "advantage": torch.tensor(list(advantages), dtype=torch.float32)}
