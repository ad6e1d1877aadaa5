"""Rows of every training field for the fetch tests (unit and the gloo ranks' worker script). Not a test module."""

from __future__ import annotations

import torch

from replay.storage import row_keys


def make_rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = list(row_keys("bc", 5))
    resp = [3, 0, 1, 5, 2]
    cols = {
        "prompt_ids": [torch.randint(0, 2**40, (5,), generator=g) for _ in keys],
        "response_ids": [torch.randint(0, 2**40, (n,), generator=g) for n in resp],
        "gen_logprobs": [-torch.rand(n, generator=g) for n in resp],
        "response_mask": [torch.rand(n, generator=g) > 0.5 for n in resp],
        "reward": torch.rand(5, generator=g),
        "advantage": torch.randn(5, generator=g),
    }
    return keys, cols
