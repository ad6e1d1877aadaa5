"""Trainer-side fetch: `fetch_rows` validation and prefetched reads (`fetch_and_broadcast` over 2 real gloo
processes: tests/integration/test_fetch_broadcast_gloo.py)."""

from __future__ import annotations

import pytest
import torch

from replay.fetch import fetch_rows
from replay.storage import InMemoryRowStorage, StorageReadError
from tests.helpers.broadcast_rows import make_rows


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
