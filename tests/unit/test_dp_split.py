"""DP split of a train chunk: properties (hypothesis) and hand-derived cases. No Ray."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from single_controller.algorithm.dp_split import balanced_partition, dp_split, split_chunk
from single_controller.types import TrainChunk

lengths_st = st.lists(st.integers(0, 64), min_size=0, max_size=40)


def keys_for(lengths):
    return [f"r{i}" for i in range(len(lengths))]


def brute_force_optimum(lengths, num_bins):
    """Least possible max load with every bin holding floor(B/N) or ceil(B/N) rows."""
    n = len(lengths)
    floor, rem = divmod(n, num_bins)
    best = None
    for assign in itertools.product(range(num_bins), repeat=n):
        counts = [assign.count(b) for b in range(num_bins)]
        if sorted(counts) != sorted([floor + 1] * rem + [floor] * (num_bins - rem)):
            continue
        load = max(sum(lengths[i] for i in range(n) if assign[i] == b) for b in range(num_bins))
        best = load if best is None else min(best, load)
    return best


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, num_ranks=st.integers(1, 5), num_microbatches=st.integers(1, 4))
def test_every_row_once_counts_balanced(lengths, num_ranks, num_microbatches):
    keys = keys_for(lengths)
    split = dp_split(keys, lengths, num_ranks, num_microbatches)
    assert split.num_ranks == num_ranks
    # equal microbatch counts on every rank
    assert all(len(mbs) == num_microbatches for mbs in split.microbatches)
    placed = [k for r in range(num_ranks) for k in split.rank_keys(r)]
    assert sorted(placed) == sorted(keys)  # every row exactly once
    rank_counts = [len(split.rank_keys(r)) for r in range(num_ranks)]
    assert max(rank_counts) - min(rank_counts) <= 1
    mb_counts = [len(mb) for mbs in split.microbatches for mb in mbs]
    assert max(mb_counts) - min(mb_counts) <= 1  # within and across ranks
    index = {k: i for i, k in enumerate(keys)}
    for r, mbs in enumerate(split.microbatches):
        for m, mb in enumerate(mbs):
            assert split.tokens[r][m] == sum(lengths[index[k]] for k in mb)
            assert [index[k] for k in mb] == sorted(index[k] for k in mb)  # chunk order kept


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, num_bins=st.integers(1, 6))
def test_max_load_within_average_plus_longest(lengths, num_bins):
    bins = balanced_partition(lengths, num_bins)
    loads = [sum(lengths[i] for i in b) for b in bins]
    longest = max(lengths, default=0)
    # average <= optimum, so this implies max load <= optimum + longest row
    assert max(loads, default=0) <= sum(lengths) / num_bins + longest


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 50), min_size=0, max_size=7), num_bins=st.integers(1, 3))
def test_max_load_within_optimum_plus_longest(lengths, num_bins):
    bins = balanced_partition(lengths, num_bins)
    got = max((sum(lengths[i] for i in b) for b in bins), default=0)
    assert got <= brute_force_optimum(lengths, num_bins) + max(lengths, default=0)


@given(lengths=lengths_st, num_ranks=st.integers(1, 5))
def test_deterministic(lengths, num_ranks):
    keys = keys_for(lengths)
    assert dp_split(keys, lengths, num_ranks, 2) == dp_split(list(keys), list(lengths), num_ranks, 2)


def test_hand_cases():
    # [5,5,5,5,3,3] on 2 ranks: longest first alternates -> {0,2,4} and {1,3,5}, 13 tokens each.
    split = dp_split(keys_for([5, 5, 5, 5, 3, 3]), [5, 5, 5, 5, 3, 3], 2)
    assert split.microbatches == ((("r0", "r2", "r4"),), (("r1", "r3", "r5"),))
    assert split.tokens == ((13,), (13,))
    # [8,7,6,5,4] on 2 ranks (3 + 2 rows): greedy 8|7, 6->7 (13), 5->8 (13), 4->rank 0 (tie) = 17|13;
    # round-robin 8+6+4=18|12. Greedy kept. (The optimum is 15|15: the guarantee is +longest, not optimal.)
    split = dp_split(keys_for([8, 7, 6, 5, 4]), [8, 7, 6, 5, 4], 2)
    assert split.tokens == ((17,), (13,))
    assert split.microbatches == ((("r0", "r3", "r4"),), (("r1", "r2"),))
    # One long row and many short ones: the long row's rank takes fewer short ones (counts still +-1).
    split = dp_split(keys_for([100, 1, 1, 1, 1, 1]), [100, 1, 1, 1, 1, 1], 2)
    assert split.tokens == ((102,), (3,))
    # Fewer rows than ranks x microbatches: empty microbatches, same count everywhere.
    # Ranks: 3 | 2, then 1 joins the lighter rank -> a | b c; rank 0 splits 1 row into 2 microbatches.
    split = dp_split(["a", "b", "c"], [3, 2, 1], 2, 2)
    assert split.microbatches == ((("a",), ()), (("b",), ("c",)))
    # One rank, one microbatch: every row in chunk order (the greedy's answer, taken without it).
    split = dp_split(keys_for([2, 9, 4, 9]), [2, 9, 4, 9], 1)
    assert split.microbatches == ((("r0", "r1", "r2", "r3"),),) and split.tokens == ((24,),)
    assert balanced_partition([], 1) == [[]]
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        balanced_partition([3, -1], 1)


def test_rank_advantages_follow_the_keys_asked_for():
    chunk = TrainChunk(1, 0, ("a", "b", "c"), (4, 4, 4), ("reward",), (0.5, -1.0, 2.0))
    assert chunk.rank_advantages(("a", "b", "c")) == [0.5, -1.0, 2.0]  # one rank: all, in order
    assert chunk.rank_advantages(("c", "a")) == [2.0, 0.5]
    assert TrainChunk(1, 0, ("a",), (4,), ("reward",)).rank_advantages(("a",)) is None
    with pytest.raises(ValueError, match="2 advantages for 3 keys"):
        TrainChunk(1, 0, ("a", "b", "c"), (4, 4, 4), ("reward",), (0.5, 1.0)).rank_advantages(("a", "b", "c"))


def test_split_chunk_and_errors():
    chunk = TrainChunk(
        step=1, chunk_index=0, row_keys=("a", "b", "c", "d"), seq_lengths=(8, 8, 8, 8), fields=("reward",)
    )
    split = split_chunk(chunk, 2)
    assert [split.rank_tokens(r) for r in range(2)] == [16, 16]
    with pytest.raises(ValueError, match="3 keys but 2 seq_lengths"):
        dp_split(["a", "b", "c"], [1, 2], 2)
    with pytest.raises(ValueError, match="duplicate keys"):
        dp_split(["a", "a"], [1, 2], 2)
    with pytest.raises(ValueError, match="num_bins must be >= 1"):
        dp_split(["a"], [1], 0)
