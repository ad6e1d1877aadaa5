"""Split a train chunk's rows over data-parallel ranks, balanced by tokens (pure, deterministic).

`dp_split(keys, seq_lengths, num_ranks, num_microbatches)` assigns every row to exactly one (rank,
microbatch). Every rank gets the same number of microbatches (DDP ranks must run the same number of
collective rounds, so a rank with too few rows still gets empty ones), and row counts differ by at
most one between ranks and between a rank's microbatches. `balanced_partition` is a greedy
longest-first fill under that count cap, checked against a round-robin deal, which bounds the
heaviest bin by the optimum plus the longest row; rows keep their chunk order inside a bin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from single_controller.types import TrainChunk


@dataclass(frozen=True)
class DPSplit:
    """microbatches[r][m] are the row keys of microbatch m on rank r; tokens[r][m] their tokens."""

    microbatches: tuple[tuple[tuple[str, ...], ...], ...]  # [R][M] -> keys
    tokens: tuple[tuple[int, ...], ...]  # [R][M]

    @property
    def num_ranks(self) -> int:
        return len(self.microbatches)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches[0]) if self.microbatches else 0

    def rank_keys(self, rank: int) -> tuple[str, ...]:
        return tuple(k for mb in self.microbatches[rank] for k in mb)

    def rank_tokens(self, rank: int) -> int:
        return sum(self.tokens[rank])


def _max_load(bins: list[list[int]], lengths: Sequence[int]) -> int:
    return max((sum(lengths[i] for i in b) for b in bins), default=0)


def balanced_partition(lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    """Indices of `lengths` split into `num_bins` bins: counts within +-1, token loads balanced
    (see the module docstring). Each bin lists its indices in increasing order."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    n = len(lengths)
    if num_bins == 1:  # what the greedy gives (every row, in order), without the sort: one rank, one microbatch
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    floor, rem = divmod(n, num_bins)

    greedy: list[list[int]] = [[] for _ in range(num_bins)]
    load = [0] * num_bins
    at_ceil = 0  # bins holding ceil rows (only counted when ceil > floor)
    for i in order:
        best = -1
        for b in range(num_bins):
            count = len(greedy[b])
            has_room = count < floor or (rem and count == floor and at_ceil < rem)
            if has_room and (best < 0 or (load[b], count) < (load[best], len(greedy[best]))):
                best = b
        if rem and len(greedy[best]) == floor:
            at_ceil += 1
        greedy[best].append(i)
        load[best] += lengths[i]

    dealt: list[list[int]] = [order[b::num_bins] for b in range(num_bins)]
    chosen = greedy if _max_load(greedy, lengths) <= _max_load(dealt, lengths) else dealt
    return [sorted(b) for b in chosen]


def dp_split(keys: Sequence[str], seq_lengths: Sequence[int], num_ranks: int, num_microbatches: int = 1) -> DPSplit:
    """Assign rows to `num_ranks` ranks x `num_microbatches` microbatches, balanced by tokens."""
    if len(keys) != len(seq_lengths):
        raise ValueError(f"{len(keys)} keys but {len(seq_lengths)} seq_lengths")
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate keys")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    ranks, tokens = [], []
    for rank_rows in balanced_partition(seq_lengths, num_ranks):
        mbs = balanced_partition([seq_lengths[i] for i in rank_rows], num_microbatches)
        ranks.append(tuple(tuple(keys[rank_rows[j]] for j in mb) for mb in mbs))
        tokens.append(tuple(sum(seq_lengths[rank_rows[j]] for j in mb) for mb in mbs))
    return DPSplit(tuple(ranks), tuple(tokens))


def split_chunk(chunk: TrainChunk, num_ranks: int, num_microbatches: int = 1) -> DPSplit:
    return dp_split(chunk.row_keys, chunk.seq_lengths, num_ranks, num_microbatches)
