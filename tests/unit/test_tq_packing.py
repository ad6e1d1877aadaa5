"""TransferQueue's packed rows (`replay/transferqueue/storage.py` `pack_rows`, `unpack_rows`), pure: every dtype and
empty rows round trip, ragged rows pack jagged and equal-length rows dense, a field the put did not carry is left out
whole. The storage against a real TransferQueue: tests/integration/test_tq_storage.py."""

from __future__ import annotations

import torch


def test_packed_rows_round_trip_every_dtype_and_empty_rows():
    from replay.storage import FieldSpec
    from replay.transferqueue.storage import pack_rows, unpack_rows

    specs = (
        FieldSpec("a", torch.int64, jagged=True, bulk=True),
        FieldSpec("b", torch.bool, jagged=True, bulk=True),
        FieldSpec("c", torch.bfloat16, jagged=True, bulk=True),
        FieldSpec("d", torch.float32, jagged=True, bulk=True),
    )
    g = torch.Generator().manual_seed(0)
    lengths = [0, 1, 3, 7]
    cols = {
        "a": [torch.randint(-(2**62), 2**62, (n,), generator=g) for n in lengths],
        "b": [torch.rand(n, generator=g) > 0.5 for n in lengths],
        "c": [torch.randn(n, generator=g).to(torch.bfloat16) for n in lengths],
        "d": [torch.randn(n, generator=g) for n in lengths],
    }
    packed = pack_rows(specs, len(lengths), cols)  # ragged rows: a jagged NestedTensor
    assert packed.is_nested and packed.dtype == torch.uint8
    assert all(r.numel() % 8 == 0 for r in packed.unbind())
    for value in (packed, torch.nested.nested_tensor(list(packed.unbind()))):  # jagged, and strided as TQ may return
        got = unpack_rows(specs, ["d", "a", "b", "c"], value)
        for name in cols:
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(got[name], cols[name], strict=True)), (
                name
            )
    # equal-length rows go dense [B, L]
    same = {name: [col[3]] * 3 for name, col in cols.items()}
    dense = pack_rows(specs, 3, same)
    assert not dense.is_nested and dense.shape[0] == 3
    got = unpack_rows(specs, ["a", "c"], dense)
    assert set(got) == {"a", "c"} and all(torch.equal(x, cols["c"][3]) for x in got["c"])
    # a field the put did not carry is left out whole, never returned short
    partial = pack_rows(specs, 2, {"a": cols["a"][:2]})
    assert set(unpack_rows(specs, ["a", "d"], partial)) == {"a"}
