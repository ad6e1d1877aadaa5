"""Row storage: where rollout rows live between generation and training.

Contract (`RowStorage`): put / get / clear rows by key (`{group_id}_g{i}`). Each field has one
`FieldSpec` for the whole run, and a put that would change a dtype is refused before anything is
written. Every get is validated: a short read or a missing field raises `StorageReadError`, never
silently. `InMemoryRowStorage` mimics TransferQueue's KV API for tests and the simulated backend;
`replay.transferqueue.storage.TQRowStorage` is the TransferQueue implementation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

# Column values: jagged fields are a list of 1-D tensors (one per row); scalar fields a 1-D tensor [B].
Column = Sequence[torch.Tensor] | torch.Tensor
Columns = Mapping[str, Column]


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: torch.dtype
    jagged: bool  # True: a 1-D tensor of any length per row; False: one scalar per row
    bulk: bool = False  # bulk fields (token ids, logprobs) are read by trainers only, never the controller


# The rollout row schema. Advantages are written back later under the same keys.
ROLLOUT_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("prompt_ids", torch.int64, jagged=True, bulk=True),
    FieldSpec("response_ids", torch.int64, jagged=True, bulk=True),
    FieldSpec("gen_logprobs", torch.float32, jagged=True, bulk=True),  # per response token
    FieldSpec("response_mask", torch.bool, jagged=True, bulk=True),  # per response token, True = trained
    FieldSpec(
        "token_versions", torch.int64, jagged=True, bulk=True
    ),  # per response token: policy version that sampled it
    FieldSpec("reward", torch.float32, jagged=False),
    FieldSpec("advantage", torch.float32, jagged=False),
)
ROLLOUT_SCHEMA: dict[str, FieldSpec] = {f.name: f for f in ROLLOUT_FIELDS}
GENERATION_FIELDS = ("prompt_ids", "response_ids", "gen_logprobs", "response_mask", "token_versions", "reward")
TRAIN_FIELDS = ("prompt_ids", "response_ids", "gen_logprobs", "response_mask", "token_versions", "advantage")
# What a trainer rank reads from storage when the chunk carries the advantages (`TrainChunk.advantages`).
TRAIN_ROW_FIELDS = tuple(f for f in TRAIN_FIELDS if f != "advantage")
# What a trainer rank reads to measure a row's KL to the reference for the reward (`reward.kl_coef`).
REWARD_KL_FIELDS = ("prompt_ids", "response_ids", "gen_logprobs", "response_mask")
BULK_FIELDS = frozenset(f.name for f in ROLLOUT_FIELDS if f.bulk)


def row_bulk_fields(schema: Mapping[str, FieldSpec]) -> tuple[str, ...]:
    """A row's bulk jagged fields (token ids, logprobs, mask, versions), in schema order. They are
    written together: a put carrying any of them replaces all of the row's (TQRowStorage stores them
    as one packed field; InMemoryRowStorage drops the ones the put lacks), so every storage reads
    back the same rows."""
    return tuple(name for name, spec in schema.items() if spec.bulk and spec.jagged)


def row_keys(group_id: str, group_size: int) -> tuple[str, ...]:
    return tuple(f"{group_id}_g{i}" for i in range(group_size))


class StorageError(RuntimeError):
    """Base class of row-storage errors."""


class StorageWriteError(StorageError, ValueError):
    """A put was refused before anything reached the store (bad keys, shapes or dtypes)."""


class StorageReadError(StorageError, KeyError):
    """A read came back short or incomplete; names the missing keys and fields."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class StorageStatistics:
    puts: int
    gets: int
    clears: int
    rows_put: int
    rows_read: int
    bytes_put: int
    bytes_read: int
    resident_rows: int  # rows this client knows to be stored and not yet cleared (-1: unknown)


def column_nbytes(col: Column) -> int:
    if isinstance(col, torch.Tensor):
        return col.nbytes
    return sum(t.nbytes for t in col)


def validate_put(
    schema: Mapping[str, FieldSpec],
    keys: Sequence[str],
    columns: Columns,
    tags: Sequence[Mapping[str, Any]] | None,
) -> None:
    """Check a put completely before any of it is written; raise one error listing every problem."""
    problems: list[str] = []
    if not keys:
        problems.append("no keys")
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if list(keys).count(k) > 1})
        problems.append(f"duplicate keys {dup[:5]}")
    if any(not isinstance(k, str) or not k for k in keys):
        problems.append("every key must be a non-empty str")
    if not columns:
        problems.append("no fields")
    if tags is not None and len(tags) != len(keys):
        problems.append(f"{len(tags)} tags for {len(keys)} keys")
    for name, col in columns.items():
        spec = schema.get(name)
        if spec is None:
            problems.append(f"unknown field {name!r} (schema: {sorted(schema)})")
            continue
        n = col.shape[0] if isinstance(col, torch.Tensor) and not spec.jagged else len(col)
        if n != len(keys):
            problems.append(f"field {name!r} has {n} rows for {len(keys)} keys")
            continue
        if spec.jagged:
            rows = list(col)
            bad = [i for i, t in enumerate(rows) if not isinstance(t, torch.Tensor) or t.dim() != 1]
            if bad:
                problems.append(f"field {name!r} must be one 1-D tensor per row (rows {bad[:5]})")
                continue
            dtypes = {t.dtype for t in rows}
            if dtypes != {spec.dtype}:
                problems.append(f"field {name!r} dtype {sorted(map(str, dtypes))} != schema {spec.dtype}")
        else:
            if not isinstance(col, torch.Tensor) or col.dim() != 1:
                problems.append(f"field {name!r} must be a 1-D tensor [B] of scalars")
            elif col.dtype != spec.dtype:
                problems.append(f"field {name!r} dtype {col.dtype} != schema {spec.dtype}")
    if problems:
        raise StorageWriteError("refused put: " + "; ".join(problems))


def validate_read(
    schema: Mapping[str, FieldSpec],
    keys: Sequence[str],
    fields: Sequence[str],
    got: Mapping[str, Column],
    got_rows: int,
    missing_keys: Sequence[str] = (),
) -> None:
    """Raise `StorageReadError` unless `got` has exactly len(keys) rows of every asked field."""
    problems: list[str] = []
    if missing_keys:
        problems.append(f"missing keys {list(missing_keys)[:10]} ({len(missing_keys)} of {len(keys)})")
    elif got_rows != len(keys):
        problems.append(f"got {got_rows} rows for {len(keys)} keys")
    absent = [f for f in fields if f not in got]
    if absent:
        problems.append(f"missing fields {absent}")
    for name in fields:
        if name not in got:
            continue
        spec, col = schema[name], got[name]
        n = len(col) if spec.jagged else (col.shape[0] if isinstance(col, torch.Tensor) else len(col))
        if n != len(keys):
            problems.append(f"field {name!r} has {n} rows for {len(keys)} keys")
        elif spec.jagged:
            wrong = {t.dtype for t in col} - {spec.dtype}
            if wrong:
                problems.append(f"field {name!r} came back as {sorted(map(str, wrong))}, schema {spec.dtype}")
        elif not isinstance(col, torch.Tensor):
            problems.append(f"field {name!r} came back as a list of rows, schema {spec.dtype} scalars")
        elif col.dtype != spec.dtype:
            problems.append(f"field {name!r} came back as {col.dtype}, schema {spec.dtype}")
    if problems:
        raise StorageReadError(f"short or incomplete read of {len(keys)} keys: " + "; ".join(problems))


@runtime_checkable
class RowStorage(Protocol):
    """Async row storage used on the controller's loop (and by async workers)."""

    schema: Mapping[str, FieldSpec]

    async def put_rows(
        self, keys: Sequence[str], columns: Columns, tags: Sequence[Mapping[str, Any]] | None = None
    ) -> None: ...

    async def get_rows(self, keys: Sequence[str], fields: Sequence[str]) -> dict[str, Column]: ...

    async def clear_rows(self, keys: Sequence[str]) -> None: ...

    async def resident_keys(self) -> set[str]: ...

    def statistics(self) -> StorageStatistics: ...


class InMemoryRowStorage:
    """A process-local store with TransferQueue's semantics, for tests and the simulated backend.

    Like TQ, a field is stored per row; unlike TQ, it never returns short reads unvalidated.
    Thread-unsafe by design: it lives on one event loop.
    """

    def __init__(self, schema: Mapping[str, FieldSpec] = ROLLOUT_SCHEMA):
        self.schema: Mapping[str, FieldSpec] = dict(schema)
        self._rows: dict[str, dict[str, Any]] = {}
        self._tags: dict[str, dict[str, Any]] = {}
        self._counts = dict(puts=0, gets=0, clears=0, rows_put=0, rows_read=0, bytes_put=0, bytes_read=0)

    # The synchronous core; the async methods below are what the Protocol names.
    def put_rows_sync(self, keys, columns, tags=None) -> None:
        validate_put(self.schema, keys, columns, tags)
        # keep copies: a jagged column row by row, a dense one in one clone whose rows are views
        kept = {name: col if self.schema[name].jagged else col.clone() for name, col in columns.items()}
        bulk = set(row_bulk_fields(self.schema))
        replaced = bulk - set(columns) if bulk & set(columns) else set()  # a put of bulk fields replaces them all
        for i, key in enumerate(keys):
            row = self._rows.setdefault(key, {})
            for name in replaced:
                row.pop(name, None)
            for name, col in kept.items():
                row[name] = col[i].clone() if self.schema[name].jagged else col[i]
            if tags is not None:
                self._tags.setdefault(key, {}).update(tags[i])
        self._counts["puts"] += 1
        self._counts["rows_put"] += len(keys)
        self._counts["bytes_put"] += sum(column_nbytes(c) for c in columns.values())

    def get_rows_sync(self, keys, fields) -> dict[str, Column]:
        unknown = [f for f in fields if f not in self.schema]
        if unknown:
            raise StorageReadError(f"unknown fields {unknown} (schema: {sorted(self.schema)})")
        present = [k for k in keys if k in self._rows]
        missing = [k for k in keys if k not in self._rows]
        got: dict[str, Column] = {}
        for name in fields:
            if not all(name in self._rows[k] for k in present):
                continue  # like TQ: a field not every row has is absent from the result
            vals = [self._rows[k][name] for k in present]
            got[name] = vals if self.schema[name].jagged else torch.stack(vals) if vals else torch.empty(0)
        validate_read(self.schema, keys, fields, got, len(present), missing)
        self._counts["gets"] += 1
        self._counts["rows_read"] += len(keys)
        self._counts["bytes_read"] += sum(column_nbytes(c) for c in got.values())
        return got

    def clear_rows_sync(self, keys) -> None:
        for k in keys:  # absent or not
            self._rows.pop(k, None)
            self._tags.pop(k, None)
        self._counts["clears"] += 1

    def tags(self, key: str) -> dict[str, Any]:
        return dict(self._tags.get(key, {}))

    async def put_rows(self, keys, columns, tags=None) -> None:
        self.put_rows_sync(keys, columns, tags)

    async def get_rows(self, keys, fields) -> dict[str, Column]:
        return self.get_rows_sync(keys, fields)

    async def clear_rows(self, keys) -> None:
        self.clear_rows_sync(keys)

    async def resident_keys(self) -> set[str]:
        return set(self._rows)

    def statistics(self) -> StorageStatistics:
        return StorageStatistics(resident_rows=len(self._rows), **self._counts)


class LazyRowStorage:
    """Defers building a worker's storage client until first use (or `connect()`), so worker
    processes can be started while the storage service itself is still starting."""

    def __init__(self, factory):
        self._factory = factory
        self._storage = None

    def connect(self):
        if self._storage is None:
            self._storage = self._factory()
        return self._storage

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.connect(), name)
