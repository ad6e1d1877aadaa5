"""`TQRowStorage`: the `RowStorage` the controller and the workers use, on TransferQueue's KV API.

One partition per run, one key per row or per group (`group_rows`). On top of `RowStorage`: every
put is validated before it reaches TQ (TQ registers keys before checking data and silently casts a
changed dtype); every get is validated (TQ answers missing keys with fewer rows), at no cost on the
hot path; every TQ call has a deadline (`TimeoutConfig.storage_s`: TQ's RPCs have none). The
`*_sync` twins run the same coroutines on one private loop thread per process. Open it with
`replay.transferqueue.factory`. Importing it imports TransferQueue the package's way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch

from replay.transferqueue import shims
from replay.transferqueue.common import TQRuntimeError, client_connected, import_transfer_queue
from replay.transferqueue.runtime import attach_tq

tq = import_transfer_queue()

from tensordict import NonTensorData, NonTensorStack, TensorDict  # noqa: E402

from replay.storage import (  # noqa: E402
    ROLLOUT_SCHEMA,
    Column,
    Columns,
    FieldSpec,
    StorageError,
    StorageReadError,
    StorageStatistics,
    StorageWriteError,
    column_nbytes,
    row_bulk_fields,
    validate_put,
    validate_read,
)
from single_controller.deadlines import DeadlineExceeded, within  # noqa: E402

warnings.filterwarnings(
    "ignore", message=r"The PyTorch API of nested tensors is in prototype stage", category=UserWarning
)


class _DropFxTracingNotice(logging.Filter):
    """torch.nested.nested_tensor_from_jagged logs a one-off is_fx_tracing deprecation notice, in every process."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropFxTracingNotice())

T = TypeVar("T")

_SYNC_GRACE_S = 5.0  # the sync twin's backstop beyond the coroutine's own deadline
_MAX_PROBED_KEYS = 64  # error path: keys probed one by one to name those registered without data


# ---------------------------------------------------------------- conversion (pure)
# A row's bulk jagged fields (token ids, logprobs, mask, versions) travel packed into ONE TQ field:
# TQ's cost is per (row, field) -- every storage unit and client encodes and decodes each row's
# tensor of each field on its own -- so five fields in one cut the data plane's CPU per step
# (`sc-grpo bench storage`, docs/performance.md). The packed row is a
# uint8 tensor: an int64 header with each packed field's element count (-1: not in this put), then
# each present field's bytes in schema order, each padded to 8 bytes. Scalar fields stay TQ fields of
# their own (the controller reads them without touching bulk data). A put of bulk fields replaces all
# of the row's bulk fields (`replay.storage`: the same in every row storage).
PACKED_FIELD = "bulk"


def packed_specs(schema: Mapping[str, FieldSpec]) -> tuple[FieldSpec, ...]:
    """The fields that travel packed: bulk and jagged (`replay.storage.row_bulk_fields`), schema order."""
    return tuple(schema[name] for name in row_bulk_fields(schema))


def stored_fields(schema: Mapping[str, FieldSpec], fields: Sequence[str]) -> list[str]:
    """The TQ fields that hold `fields`."""
    packed = set(row_bulk_fields(schema))
    out = [f for f in fields if f not in packed]
    if any(f in packed for f in fields):
        out.append(PACKED_FIELD)
    return out


def _gather(starts: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Indices of the byte runs [starts[i], starts[i] + nbytes[i]) laid end to end."""
    total = int(nbytes.sum())
    run_base = np.cumsum(nbytes) - nbytes  # where each run begins in the output
    return np.repeat(starts - run_base, nbytes) + np.arange(total, dtype=np.int64)


def pack_rows(specs: Sequence[FieldSpec], num_rows: int, columns: Columns) -> torch.Tensor:
    """The `specs` fields present in `columns` -> one packed uint8 row per key, as TQ takes rows:
    a dense [B, L] tensor when every row has the same length, else a jagged NestedTensor.
    Vectorized over rows (one concatenation per field): no per-row tensor ops."""
    F = len(specs)
    head = 8 * F
    header = np.full((num_rows, F), -1, dtype=np.int64)  # element counts; -1: field not in this put
    flats: list[tuple[int, np.ndarray]] = []
    for i, spec in enumerate(specs):
        if spec.name not in columns:
            continue
        rows = list(columns[spec.name])  # 1-D tensors (validate_put); callers hold no grad here
        header[:, i] = [t.shape[0] for t in rows]
        flat = torch.cat(rows) if rows else torch.empty(0, dtype=spec.dtype)
        flats.append((i, flat.contiguous().view(torch.uint8).numpy()))
    itemsizes = np.array([torch.empty(0, dtype=s.dtype).element_size() for s in specs], dtype=np.int64)
    sizes = np.maximum(header, 0) * itemsizes  # bytes per (row, field)
    padded = sizes + (-sizes % 8)
    row_len = head + padded.sum(axis=1)  # [B]
    row_start = np.cumsum(row_len) - row_len
    field_start = row_start[:, None] + head + np.cumsum(padded, axis=1) - padded  # [B, F]
    out = np.zeros(int(row_len.sum()), dtype=np.uint8)
    out[_gather(row_start, np.full(num_rows, head, dtype=np.int64))] = header.view(np.uint8).reshape(-1)
    for i, field_bytes in flats:
        out[_gather(field_start[:, i], sizes[:, i])] = field_bytes
    values = torch.from_numpy(out)
    if num_rows and (row_len == row_len[0]).all():
        return values.view(num_rows, int(row_len[0]))  # [B, L]
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(row_len)]))  # [B+1]
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def _contiguous_offsets(value: torch.Tensor) -> torch.Tensor | None:
    """A jagged NestedTensor's offsets [B+1] when its rows lie back to back in `values()`; else None
    (dense, strided nested, or a jagged one with holes)."""
    # `_lengths` and `offsets()` are torch's NestedTensor subclass's, absent from the Tensor stubs
    if value.is_nested and value.layout == torch.jagged and value._lengths is None:  # type: ignore[attr-defined]
        return value.offsets()  # type: ignore[attr-defined]
    return None


def _packed_buffer(value: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """What TQ returned for the packed field -> (all rows' bytes, each row's start in them)."""
    jagged_offsets = _contiguous_offsets(value)
    if jagged_offsets is not None:
        offsets = jagged_offsets.numpy()
        return value.values().numpy(), offsets[:-1].astype(np.int64)
    if not value.is_nested:  # dense [B, L]
        B, L = value.shape
        return value.reshape(-1).numpy(), np.arange(B, dtype=np.int64) * L
    rows = _rows(value)  # strided nested (mixed layouts): one copy
    lengths = np.array([r.numel() for r in rows], dtype=np.int64)
    return torch.cat(rows).numpy() if rows else np.zeros(0, np.uint8), np.cumsum(lengths) - lengths


def unpack_rows(
    specs: Sequence[FieldSpec], wanted: Sequence[str], value: torch.Tensor
) -> dict[str, list[torch.Tensor]]:
    """The packed field as TQ returned it -> the `wanted` fields' columns (one 1-D tensor per row,
    views of one buffer per field). A field missing from any row is left out whole (validate_read
    then names it), never returned short."""
    return _unpack_at(specs, wanted, *_packed_buffer(value))


def _unpack_at(
    specs: Sequence[FieldSpec], wanted: Sequence[str], buf: np.ndarray, row_start: np.ndarray
) -> dict[str, list[torch.Tensor]]:
    """`unpack_rows` of the packed rows that begin at `row_start` in `buf` (in that order)."""
    F = len(specs)
    head = 8 * F
    B = len(row_start)
    header = buf[_gather(row_start, np.full(B, head, dtype=np.int64))].view(np.int64).reshape(B, F)
    itemsizes = np.array([torch.empty(0, dtype=s.dtype).element_size() for s in specs], dtype=np.int64)
    sizes = np.maximum(header, 0) * itemsizes
    padded = sizes + (-sizes % 8)
    field_start = row_start[:, None] + head + np.cumsum(padded, axis=1) - padded  # [B, F]
    out: dict[str, list[torch.Tensor]] = {}
    for i, spec in enumerate(specs):
        if spec.name not in wanted or (header[:, i] < 0).any():
            continue
        data = torch.from_numpy(buf[_gather(field_start[:, i], sizes[:, i])])  # a fresh, aligned copy
        # (an empty one may have stride 0)
        flat = data.view(spec.dtype) if data.numel() else torch.empty(0, dtype=spec.dtype)
        out[spec.name] = list(torch.split(flat, header[:, i].tolist()))
    return out


def to_tensordict(schema: Mapping[str, FieldSpec], num_rows: int, columns: Columns) -> TensorDict:
    """Validated columns -> the TensorDict TQ stores: the bulk jagged fields packed into one jagged
    uint8 field (`PACKED_FIELD`), other jagged fields -> jagged NestedTensor, scalars -> [B]."""
    data: dict[str, torch.Tensor] = {}
    specs = packed_specs(schema)
    packed = {s.name for s in specs}
    with torch.no_grad():
        for name, col in columns.items():
            if name in packed:
                continue
            if schema[name].jagged:
                data[name] = _jagged(list(col))
            else:
                assert isinstance(col, torch.Tensor), "validate_put: a scalar field is one tensor [B]"
                data[name] = col.detach()
        if any(name in packed for name in columns):
            data[PACKED_FIELD] = pack_rows(specs, num_rows, columns)
    return TensorDict(data, batch_size=[num_rows])


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of one jagged field -> what TQ stores. Equal-length rows go as a dense [B, L] tensor: TQ
    puts those faster than a NestedTensor (one frame, not one per row), keeps every row's shape
    and dtype, and returns them as a jagged NestedTensor like any other (mixing both kinds of puts
    in one partition reads back exactly)."""
    sizes = [t.numel() for t in rows]
    if min(sizes) == max(sizes):
        return torch.stack(rows)  # [B, L]
    # values + offsets: cheaper than torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    lengths = torch.tensor(sizes, dtype=torch.int64)  # [B]
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)  # [B+1]
    torch.cumsum(lengths, 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(torch.cat(rows), offsets=offsets)


def _rows(value: torch.Tensor) -> list[torch.Tensor]:
    """A batch of 1-D rows -> list of 1-D tensors (views)."""
    offsets = _contiguous_offsets(value)  # [B+1]; torch.split is ~2x cheaper than NestedTensor.unbind
    if offsets is not None:
        values = value.values()[int(offsets[0]) : int(offsets[-1])]
        return list(torch.split(values, offsets.diff().tolist()))
    return list(value.unbind(0))  # strided nested (mixed-layout reads) or dense [B, L]


def from_tensordict(schema: Mapping[str, FieldSpec], fields: Sequence[str], td: TensorDict) -> dict[str, Column]:
    """What TQ returned -> columns (fields TQ left out stay absent, for validate_read to name)."""
    present = set(td.keys())
    out: dict[str, Column] = {}
    specs = packed_specs(schema)
    packed = {s.name for s in specs}
    if PACKED_FIELD in present and any(f in packed for f in fields):
        out.update(unpack_rows(specs, [f for f in fields if f in packed], td.get(PACKED_FIELD)))
    for name in fields:
        if name not in present or name in packed:
            continue
        value = td.get(name)
        if schema[name].jagged:
            out[name] = _rows(value)  # B x [L_i]
        elif value.is_nested:
            out[name] = torch.stack(value.unbind(0)).reshape(-1)  # [B]
        else:
            out[name] = value  # [B]
    return out


def empty_columns(schema: Mapping[str, FieldSpec], fields: Sequence[str]) -> dict[str, Column]:
    return {f: [] if schema[f].jagged else torch.empty(0, dtype=schema[f].dtype) for f in fields}


# ---------------------------------------------------------------- group-packed layout
# With `group_rows`, a TQ key holds a whole group: the rows `<gid>_g0 .. <gid>_g<n-1>` (`row_keys`)
# live under the key `<gid>`. Its packed field is [n, the n rows' packed lengths] (int64) followed by
# the rows packed as above; each scalar field is the group's [n] vector. TQ's cost is per (key,
# field), so a step's 16 groups cost what 16 rows did (one key per row: 256). Every field travels as
# a byte string (TQ keeps those as they are): a tensor field would come back from TQ as a jagged
# NestedTensor, whose construction imports all of torch._dynamo in the reader (a start-up cost).


def split_row_key(key: str) -> tuple[str, int] | None:
    """`<gid>_g<i>` -> (gid, i); None for a key not of that form."""
    gid, sep, idx = key.rpartition("_g")
    if not sep or not gid or not idx.isdigit() or (len(idx) > 1 and idx[0] == "0"):
        return None
    return gid, int(idx)


def _whole_groups(keys: Sequence[str]) -> tuple[list[str], list[int], list[int]]:
    """The put's groups (first-seen order), their sizes, and the put's row positions sorted by group
    then index. Refuses keys that are not whole groups (`StorageWriteError` naming them)."""
    members: dict[str, list[tuple[int, int]]] = {}
    bad: list[str] = []
    for pos, key in enumerate(keys):
        parsed = split_row_key(key)
        if parsed is None:
            bad.append(key)
            continue
        members.setdefault(parsed[0], []).append((parsed[1], pos))
    partial = [gid for gid, rows in members.items() if sorted(i for i, _ in rows) != list(range(len(rows)))]
    if bad or partial:
        problems = ([f"keys {bad[:5]} are not row keys <group>_g<i>"] if bad else []) + (
            [f"groups {partial[:5]} are not whole (rows _g0.._g<n-1>)"] if partial else []
        )
        raise StorageWriteError("refused put: a group-packed storage writes whole groups: " + "; ".join(problems))
    order = [pos for rows in members.values() for _, pos in sorted(rows)]
    return list(members), [len(rows) for rows in members.values()], order


def _take(col: Column, order: Sequence[int]) -> Column:
    return col[torch.as_tensor(order, dtype=torch.long)] if isinstance(col, torch.Tensor) else [col[i] for i in order]


def pack_groups(specs: Sequence[FieldSpec], sizes: Sequence[int], columns: Columns) -> list[bytes]:
    """Rows in group order (`sizes[g]` rows each) -> one packed byte string per group."""
    buf, row_start = _packed_buffer(pack_rows(specs, sum(sizes), columns))
    row_len = np.diff(np.append(row_start, len(buf)))
    out, at = [], 0
    for n in sizes:  # n >= 1: whole groups
        head = np.array([n, *row_len[at : at + n]], dtype=np.int64).tobytes()
        out.append(head + buf[row_start[at] : row_start[at + n - 1] + row_len[at + n - 1]].tobytes())
        at += n
    return out


def _byte_strings(value: Any) -> list[bytes]:
    """A group-packed field as TQ returned it (a stack of byte strings, or one) -> the list."""
    if isinstance(value, NonTensorData):
        return [value.data]
    if isinstance(value, NonTensorStack):
        return list(value.tolist())
    raise StorageReadError(f"a group-packed field came back as {type(value).__name__}, not byte strings")


def group_row_starts(groups: list[bytes]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Packed groups -> (all their bytes, each group's rows' starts in them)."""
    buf = np.frombuffer(b"".join(groups), dtype=np.uint8)
    starts, gs = [], 0
    for g in groups:
        n = int(buf[gs : gs + 8].view(np.int64)[0])
        lens = buf[gs + 8 : gs + 8 + 8 * n].view(np.int64)
        starts.append(gs + 8 + 8 * n + np.cumsum(lens) - lens)
        gs += len(g)
    return buf, starts


# ---------------------------------------------------------------- sync twins' loop
class _SyncLoop:
    """One daemon event-loop thread per process, started on first use, for the `*_sync` twins.

    TQ keys its socket pools by event loop, so one long-lived loop reuses connections; a fresh
    `asyncio.run` per call would reconnect every time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or not self._thread or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="tq-rows-sync", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def run(self, aw: Coroutine[Any, Any, T], seconds: float, what: str) -> T:
        loop = self._ensure()
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{what}: a *_sync storage method was called from its own loop thread")
        future = asyncio.run_coroutine_threadsafe(aw, loop)
        try:
            return future.result(seconds + _SYNC_GRACE_S)
        except TimeoutError:
            if future.done():
                raise  # the coroutine's own DeadlineExceeded
            future.cancel()
            raise DeadlineExceeded(what, seconds) from None


_SYNC = _SyncLoop()


# ---------------------------------------------------------------- the storage
class TQRowStorage:
    """Rows of one TQ partition. Construct it after `start_tq()`/`attach_tq()`, or use `attach()`."""

    def __init__(
        self,
        partition: str = "rollout",
        *,
        schema: Mapping[str, FieldSpec] = ROLLOUT_SCHEMA,
        timeout_s: float = 60.0,
        track_resident: bool = True,
        group_rows: bool = False,
    ):
        if not client_connected():
            raise TQRuntimeError(
                "no TransferQueue client in this process: call replay.transferqueue.runtime.start_tq() (driver) or "
                "attach_tq() first, or use TQRowStorage.attach() (any process on the Ray cluster)"
            )
        self.schema = dict(schema)
        self.partition = partition
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # the async methods and the sync twins run on different threads
        self._counts = dict(puts=0, gets=0, clears=0, rows_put=0, rows_read=0, bytes_put=0, bytes_read=0)
        self._resident: set[str] | None = set() if track_resident else None
        # One TQ key per group (see "group-packed layout"): puts write whole groups, a clear of any
        # row of a group clears the group.
        self.group_rows = group_rows
        self._resident_groups: dict[str, int] | None = {} if track_resident else None

    @classmethod
    def attach(
        cls,
        partition: str = "rollout",
        *,
        schema: Mapping[str, FieldSpec] = ROLLOUT_SCHEMA,
        timeout_s: float = 60.0,
        attach_timeout_s: float = 60.0,
        track_resident: bool = True,
        group_rows: bool = False,
    ) -> TQRowStorage:
        """For any process on the Ray cluster (e.g. inside a Ray actor's `__init__`): connect this
        process's TQ client to the running controller (never starts one), then open `partition`.
        Blocking; never call `tq.close()` / `stop_tq()` expecting to stop TQ from such a process."""
        attach_tq(attach_timeout_s)
        return cls(partition, schema=schema, timeout_s=timeout_s, track_resident=track_resident, group_rows=group_rows)

    def _what(self, op: str, n: int) -> str:
        return f"TQ {op} of {n} rows in partition {self.partition!r}"

    async def _call(self, aw: Awaitable[T], what: str) -> T:
        """Deadline on one TQ call; TQ's own errors become `StorageError`s naming the operation."""
        try:
            return await within(aw, self.timeout_s, what)
        except (DeadlineExceeded, StorageError):
            raise
        except Exception as e:
            raise StorageError(f"{what} failed: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------ async API (caller's loop)
    async def put_rows(
        self, keys: Sequence[str], columns: Columns, tags: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        keys = list(keys)
        tq_keys, td, tag_list, gids, sizes = self.encode_put(keys, columns, tags)
        await self._call(
            tq.async_kv_batch_put(keys=tq_keys, partition_id=self.partition, fields=td, tags=tag_list),
            self._what("put", len(keys)),
        )
        nbytes = sum(column_nbytes(c) for c in columns.values())
        with self._lock:
            self._counts["puts"] += 1
            self._counts["rows_put"] += len(keys)
            self._counts["bytes_put"] += nbytes
            if self.group_rows and self._resident_groups is not None:
                self._resident_groups.update(zip(gids, sizes))
            elif self._resident is not None:
                self._resident.update(keys)

    def encode_put(
        self, keys: list[str], columns: Columns, tags: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[list[str], TensorDict, list[dict] | None, list[str], list[int]]:
        """Validate a put and build what goes to TransferQueue: (TQ keys, fields, TQ tags, group ids,
        group sizes); the last two are empty in the per-row layout. No TQ call (`bench storage`
        times it on its own)."""
        validate_put(self.schema, keys, columns, tags)  # before TQ registers a single key
        if self.group_rows:
            if tags is not None:
                raise StorageWriteError("refused put: a group-packed storage keeps no per-row tags")
            gids, sizes, order = _whole_groups(keys)
            td = self._group_tensordict(sizes, {name: _take(col, order) for name, col in columns.items()})
            return gids, td, [{"rows": n} for n in sizes], gids, sizes
        td = to_tensordict(self.schema, len(keys), columns)
        return keys, td, ([dict(t) for t in tags] if tags is not None else None), [], []

    def _group_tensordict(self, sizes: Sequence[int], columns: Columns) -> TensorDict:
        """Columns in group order -> one TQ row per group: the packed field, and each other field as
        the group's [n] vector (jagged fields other than the packed ones are not group-packed)."""
        data: dict[str, torch.Tensor] = {}
        specs = packed_specs(self.schema)
        packed = {spec.name for spec in specs}
        with torch.no_grad():
            for name, col in columns.items():
                if name in packed:
                    continue
                if self.schema[name].jagged:
                    raise StorageWriteError(
                        f"refused put: field {name!r} is jagged and not packed; a group-packed storage cannot hold it"
                    )
                assert isinstance(col, torch.Tensor), "validate_put: a scalar field is one tensor [B]"
                flat = col.detach().contiguous().numpy()
                bounds = np.cumsum([0, *sizes])
                data[name] = NonTensorStack(*(flat[a:b].tobytes() for a, b in zip(bounds[:-1], bounds[1:])))
            if any(name in packed for name in columns):
                data[PACKED_FIELD] = NonTensorStack(*pack_groups(specs, sizes, columns))
        return TensorDict(data, batch_size=[len(sizes)])

    async def get_rows(self, keys: Sequence[str], fields: Sequence[str]) -> dict[str, Column]:
        keys, fields = list(keys), list(fields)
        unknown = [f for f in fields if f not in self.schema]
        if unknown:
            raise StorageReadError(f"unknown fields {unknown} (schema: {sorted(self.schema)})")
        if not keys:
            got = empty_columns(self.schema, fields)
        elif self.group_rows:
            got = await self._get_grouped(keys, fields)
        else:
            td = await self._kv_get(keys, fields, len(keys), lambda e: self._raise_short_read(keys, fields, None, e))
            got_rows = td.batch_size[0] if td.batch_dims else 0
            got = from_tensordict(self.schema, fields, td)
            if got_rows != len(keys) or len(got) != len(fields):
                await self._raise_short_read(keys, fields, td, None)
            validate_read(self.schema, keys, fields, got, got_rows)  # dtypes and per-field row counts
        nbytes = sum(column_nbytes(c) for c in got.values())
        with self._lock:
            self._counts["gets"] += 1
            self._counts["rows_read"] += len(keys)
            self._counts["bytes_read"] += nbytes
        return got

    async def _kv_get(
        self, tq_keys: list[str], fields: list[str], num_rows: int, refused: Callable[[ValueError], Awaitable[NoReturn]]
    ) -> TensorDict:
        """One TQ read of `fields` under `tq_keys`, with its deadline. TQ refuses a read of missing keys
        or unwritten fields with a ValueError: `refused` then raises the error that names them."""
        what = self._what("get", num_rows)
        try:
            return await within(
                tq.async_kv_batch_get(
                    keys=tq_keys, partition_id=self.partition, select_fields=stored_fields(self.schema, fields)
                ),
                self.timeout_s,
                what,
            )
        except ValueError as e:  # TQ: "keys or partition were not found!" / "Some fields are not ready ..."
            await refused(e)
            raise AssertionError("unreachable: `refused` raises") from e
        except DeadlineExceeded:
            raise
        except Exception as e:
            raise StorageError(f"{what} failed: {type(e).__name__}: {e}") from e

    async def _get_grouped(self, keys: list[str], fields: list[str]) -> dict[str, Column]:
        """`get_rows` on the group-packed layout: one TQ key per group, rows picked out of it."""
        parsed = [p for p in map(split_row_key, keys) if p is not None]
        gids = list(dict.fromkeys(gid for gid, _ in parsed))
        td = None
        if gids:
            td = await self._kv_get(gids, fields, len(keys), lambda e: self._raise_short_group_read(keys, fields, e))
        got_groups = (td.batch_size[0] if td.batch_dims else 0) if td is not None else 0
        # (td is None only when no key parsed: `keys` is never empty here)
        if td is None or got_groups != len(gids) or len(parsed) != len(keys):
            await self._raise_short_group_read(keys, fields, None)
        slot = {gid: g for g, gid in enumerate(gids)}
        present = set(td.keys())
        out: dict[str, Column] = {}
        specs = packed_specs(self.schema)
        packed = {spec.name for spec in specs}
        sizes: list[int] | None = None
        if PACKED_FIELD in present and any(f in packed for f in fields):
            buf, starts = group_row_starts(_byte_strings(td.get(PACKED_FIELD)))
            sizes = [len(st) for st in starts]
            if any(i >= sizes[slot[gid]] for gid, i in parsed):
                await self._raise_short_group_read(keys, fields, None)
            row_start = np.array([starts[slot[gid]][i] for gid, i in parsed], dtype=np.int64)
            out.update(_unpack_at(specs, [f for f in fields if f in packed], buf, row_start))
        for name in fields:
            if name in packed or name not in present:
                continue
            dtype = self.schema[name].dtype
            raw = _byte_strings(td.get(name))  # one [n] vector per group
            itemsize = torch.empty(0, dtype=dtype).element_size()
            lengths = [len(b) // itemsize for b in raw]
            if sizes is None and any(i >= lengths[slot[gid]] for gid, i in parsed):
                await self._raise_short_group_read(keys, fields, None)
            base = np.cumsum([0] + lengths[:-1])
            flat = (
                torch.frombuffer(bytearray(b"".join(raw)), dtype=dtype) if sum(lengths) else torch.empty(0, dtype=dtype)
            )
            out[name] = flat[torch.as_tensor([int(base[slot[gid]]) + i for gid, i in parsed], dtype=torch.long)]
        validate_read(self.schema, keys, fields, out, len(keys))  # dtypes and per-field row counts
        return out

    async def _raise_short_group_read(self, keys: list[str], fields: list[str], cause: Exception | None) -> NoReturn:
        resident = await self.list_rows()
        missing = [k for k in dict.fromkeys(keys) if k not in resident]
        if missing or cause is None:  # names the missing keys, or the fields TQ left out
            validate_read(self.schema, keys, fields, {}, 0, missing)
        raise StorageReadError(
            f"short or incomplete read of {len(keys)} keys: the groups of keys {keys[:5]} are registered in partition "
            f"{self.partition!r} without data for {fields} (a put in flight or cut short); TQ said: {cause}"
        )

    async def clear_rows(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        tq_keys = keys
        if self.group_rows:  # clears whole groups (keys not of the <group>_g<i> form cannot be resident)
            tq_keys = list(dict.fromkeys(p[0] for p in map(split_row_key, keys) if p is not None))
        if tq_keys:  # TQ: clearing unknown keys is a no-op
            await self._call(
                tq.async_kv_clear(keys=tq_keys, partition_id=self.partition), self._what("clear", len(keys))
            )
        with self._lock:
            self._counts["clears"] += 1
            if self.group_rows and self._resident_groups is not None:
                for gid in tq_keys:
                    self._resident_groups.pop(gid, None)
            elif self._resident is not None:
                self._resident.difference_update(keys)

    async def list_rows(self) -> dict[str, dict[str, Any]]:
        """Every key in the partition (put by any client) with its tags (group-packed: every row key
        of every group, with no tags)."""
        listing = await self._call(tq.async_kv_list(partition_id=self.partition), f"TQ kv_list({self.partition!r})")
        keys = dict(listing.get(self.partition, {}))
        if not self.group_rows:
            return keys
        return {f"{gid}_g{i}": {} for gid, tags in keys.items() for i in range(int((tags or {}).get("rows", 0)))}

    async def resident_keys(self) -> set[str]:
        return set(await self.list_rows())

    async def drop_partition_if_empty(self) -> bool:
        """Remove this partition from TQ's controller when it holds no key (a run sharing a TQ that
        outlives it leaves nothing behind); returns whether it did. Never touches a key."""
        if await self.list_rows():
            return False
        client = tq.get_client()
        if self.partition not in await self._call(client.async_get_partition_list(), "TQ partition list"):
            return False
        drop = shims.clear_empty_partition(client, self.partition)
        if drop is None:
            return False
        await self._call(drop, f"TQ drop of the empty partition {self.partition!r}")
        return True

    def statistics(self) -> StorageStatistics:
        with self._lock:
            if self.group_rows:
                resident = sum(self._resident_groups.values()) if self._resident_groups is not None else -1
            else:
                resident = len(self._resident) if self._resident is not None else -1
            return StorageStatistics(resident_rows=resident, **self._counts)

    # ------------------------------------------------------------ sync twins (worker processes)
    def put_rows_sync(
        self, keys: Sequence[str], columns: Columns, tags: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        _SYNC.run(self.put_rows(keys, columns, tags), self.timeout_s, self._what("put", len(keys)))

    def get_rows_sync(self, keys: Sequence[str], fields: Sequence[str]) -> dict[str, Column]:
        # The error path may take a few more calls, each under its own deadline: allow for them.
        return _SYNC.run(self.get_rows(keys, fields), 3 * self.timeout_s, self._what("get", len(keys)))

    def clear_rows_sync(self, keys: Sequence[str]) -> None:
        _SYNC.run(self.clear_rows(keys), self.timeout_s, self._what("clear", len(keys)))

    def list_rows_sync(self) -> dict[str, dict[str, Any]]:
        return _SYNC.run(self.list_rows(), self.timeout_s, f"TQ kv_list({self.partition!r})")

    def resident_keys_sync(self) -> set[str]:
        return set(self.list_rows_sync())

    # ------------------------------------------------------------ error path of a get
    async def _raise_short_read(
        self, keys: list[str], fields: list[str], td: TensorDict | None, cause: Exception | None
    ) -> NoReturn:
        """Name what is missing (one kv_list, plus per-key probes only when TQ refused the read)."""
        resident = await self.list_rows()
        missing = [k for k in dict.fromkeys(keys) if k not in resident]
        if td is not None:
            got, got_rows = from_tensordict(self.schema, fields, td), (td.batch_size[0] if td.batch_dims else 0)
        else:
            got, got_rows = empty_columns(self.schema, fields), 0  # TQ returned nothing at all
            if not missing:  # every key exists, yet TQ refused: some have no data for these fields
                unready = await self._unready_keys(list(dict.fromkeys(keys)), fields)
                raise StorageReadError(
                    f"short or incomplete read of {len(keys)} keys: keys {unready[:10]} are registered in "
                    f"partition {self.partition!r} without data for {fields} (a put in flight or cut short); "
                    f"TQ said: {cause}"
                )
        validate_read(self.schema, keys, fields, got, got_rows, missing)
        # Not reached unless the partition changed between the two calls; still never silently short.
        raise StorageReadError(
            f"short or incomplete read of {len(keys)} keys in partition {self.partition!r} "
            f"(got {got_rows} rows, fields {sorted(got)}; TQ said: {cause})"
        )

    async def _unready_keys(self, keys: list[str], fields: list[str]) -> list[str]:
        unready = []
        for key in keys[:_MAX_PROBED_KEYS]:
            try:
                await self._call(
                    tq.async_kv_batch_get(
                        keys=[key], partition_id=self.partition, select_fields=stored_fields(self.schema, fields)
                    ),
                    self._what("probe get", 1),
                )
            except StorageError:
                unready.append(key)
        return unready
