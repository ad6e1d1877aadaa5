"""The FSDP2 trainer core (`backends/fsdp/trainer.py`, issue #52) over 2 and 4 gloo ranks: each chunk
split across the ranks by length equals one full-batch step (float64, 1e-10 relative), with the
gradients reduce-scattered after each microbatch or once at finish, in token-budget passes whose
counts differ by rank, with gradient checkpointing; an aborted step leaves nothing behind."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from single_controller.algorithm.dp_split import balanced_partition
from single_controller.backends.fsdp.trainer import FsdpTrainerCore
from single_controller.backends.torch.model import TinyGPT
from single_controller.data.tasks import TOKENIZER
from single_controller.types import LossConfig
from tests.helpers.free_ports import free_port
from tests.helpers.multi_turn_rows import multi_turn_rows
from tests.helpers.trainer_rows import (
    LOSS_VARIANTS,
    SMALL,
    TRAIN,
    UPDATE_SPLITS_12,
    assert_close_rel,
    make_rows,
    reference_counts,
    reference_step,
    reference_updates,
    rows_for,
    seq_lengths,
    take,
    train_config_for,
    update_rows,
)

torch.set_num_threads(1)

NUM_ROWS = 12
CHUNKINGS = [
    [list(range(NUM_ROWS))],
    [[0], list(range(1, NUM_ROWS))],
    [[i] for i in range(0, NUM_ROWS, 3)] + [[i for i in range(NUM_ROWS) if i % 3]],
]
ROW_KINDS = {
    "single-turn": lambda: make_rows(NUM_ROWS, 11),
    "multi-turn": lambda: multi_turn_rows(3, 4, 11, TOKENIZER.vocab_size),
}
# Every option of the loss menu in every chunking, gradients reduce-scattered per microbatch; two of them
# with the reduction deferred to finish too.
SCENARIOS = [
    (kind, level, ci, reduce)
    for kind in ROW_KINDS
    for level in LOSS_VARIANTS
    for ci in range(len(CHUNKINGS))
    for reduce in ("microbatch", "finish")
    if reduce == "microbatch" or level in ("token_mean", "seq_mean_token_mean")
]


# train.updates_per_step: every option of the loss menu in 2 updates, and two of them in 3 with the
# reduction deferred too.
UPDATE_SCENARIOS = [
    (kind, level, split, reduce)
    for kind in ROW_KINDS
    for level in LOSS_VARIANTS
    for split in UPDATE_SPLITS_12
    for reduce in ("microbatch", "finish")
    if (split == "2 updates" and reduce == "microbatch") or level in ("token_mean", "kl_k3")
]

# Passes of at most this many tokens: the ranks' shares cut into different numbers of passes
PASS_BUDGET = {"single-turn": 20, "multi-turn": 32}
PASS_SCENARIOS = [
    (kind, ckpt, reduce) for kind in ROW_KINDS for ckpt in (False, True) for reduce in ("microbatch", "finish")
]


def _core(reduce: str, cfg=TRAIN) -> FsdpTrainerCore:
    return FsdpTrainerCore(
        TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), cfg, process_group=dist.group.WORLD, reduce=reduce
    )


def _step(core, rank: int, world: int, rows: dict, chunking, level: str, step: int = 0, updates=None) -> tuple:
    """One step of `rows` in `chunking` (or in `updates`, each a chunking), each chunk split across the ranks."""
    core.begin_train_step(step, LOSS_VARIANTS[level])
    for update, chunks in enumerate(updates or [chunking]):
        for chunk in chunks:
            sub = take(rows, chunk)
            core.train_microbatch(take(sub, balanced_partition(seq_lengths(sub), world)[rank]), update=update)
    m = core.finish_train_step(step)
    grads = [p.grad.full_tensor().clone() for p in core.params]
    return grads, [p.full_tensor().clone() for p in core.params], m


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    for kind, level, ci, reduce in SCENARIOS:
        core = _core(reduce, train_config_for(LOSS_VARIANTS[level]))
        rows = rows_for(level, ROW_KINDS[kind]())
        results[(kind, level, ci, reduce)] = _step(core, rank, world, rows, CHUNKINGS[ci], level)
    for kind, level, split, reduce in UPDATE_SCENARIOS:
        core = _core(reduce, train_config_for(LOSS_VARIANTS[level]))
        rows = rows_for(level, ROW_KINDS[kind]())
        updates = UPDATE_SPLITS_12[split]
        results[("updates", kind, level, split, reduce)] = _step(core, rank, world, rows, None, level, updates=updates)
    for kind, ckpt, reduce in PASS_SCENARIOS:
        cfg = dataclasses.replace(TRAIN, micro_batch_tokens=PASS_BUDGET[kind], gradient_checkpointing=ckpt)
        rows = ROW_KINDS[kind]()
        results[("passes", kind, ckpt, reduce)] = _step(
            _core(reduce, cfg), rank, world, rows, CHUNKINGS[2], "token_mean"
        )
    for reduce in ("microbatch", "finish"):  # an aborted step, then the step again: as if never aborted
        core = _core(reduce)
        core.begin_train_step(0, LossConfig())
        core.train_microbatch(take(make_rows(6, 5), balanced_partition(seq_lengths(make_rows(6, 5)), world)[rank]))
        core.abort_train_step(0)
        results[("abort", reduce)] = _step(core, rank, world, ROW_KINDS["single-turn"](), CHUNKINGS[1], "token_mean")
    # reward.kl_coef: each rank's share of the rows in passes of its own count (the sharded reference's
    # forwards padded to the rank with the most), beside an open step
    core = FsdpTrainerCore(
        TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(),
        dataclasses.replace(TRAIN, micro_batch_tokens=PASS_BUDGET["single-turn"]),
        process_group=dist.group.WORLD,
        keep_reference=True,
    )
    kl_rows = make_rows(NUM_ROWS, 4)
    mine = balanced_partition(seq_lengths(kl_rows), world)[rank] if rank else []  # rank 0: none at all
    core.begin_train_step(0, LossConfig())
    results["reward_kl"] = (mine, core.reward_kl(take(kl_rows, mine), "k3"))
    core.abort_train_step(0)
    shard = [p.to_local().numel() for p in _core("microbatch").params]
    results["shard_numel"] = sum(shard)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def fsdp_results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"fsdp{world}")
    mp.spawn(_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("kind, level, ci, reduce", SCENARIOS)
def test_fsdp_split_step_equals_full_batch(fsdp_results, kind, level, ci, reduce):
    rows = rows_for(level, ROW_KINDS[kind]())
    want_grads, want_params = reference_step(rows, LOSS_VARIANTS[level])
    for rank, res in enumerate(fsdp_results):
        grads, params, m = res[(kind, level, ci, reduce)]
        assert_close_rel(grads, want_grads, 1e-10)
        assert_close_rel(params, want_params, 1e-10)
        assert (m["train/tokens"], m["train/sequences"]) == reference_counts(rows, LOSS_VARIANTS[level]), rank


@pytest.mark.parametrize("kind, ckpt, reduce", PASS_SCENARIOS)
def test_fsdp_token_budget_passes_equal_the_full_batch_step(fsdp_results, kind, ckpt, reduce):
    """Each share cut into passes by `train.micro_batch_tokens` (the ranks' counts differ: the others
    pad), with and without gradient checkpointing: the full-batch step (1e-10)."""
    want_grads, want_params = reference_step(ROW_KINDS[kind](), LOSS_VARIANTS["token_mean"])
    passes = []
    for res in fsdp_results:
        grads, params, m = res[("passes", kind, ckpt, reduce)]
        assert_close_rel(grads, want_grads, 1e-10)
        assert_close_rel(params, want_params, 1e-10)
        passes.append(m["train/passes"])
    assert len(set(passes)) > 1 or len(fsdp_results) == 4, passes  # the counts differ: padding was needed


@pytest.mark.parametrize("reduce", ["microbatch", "finish"])
def test_an_aborted_fsdp_step_leaves_no_gradient_behind(fsdp_results, reduce):
    want_grads, want_params = reference_step(ROW_KINDS["single-turn"](), LOSS_VARIANTS["token_mean"])
    for res in fsdp_results:
        grads, params, _ = res[("abort", reduce)]
        assert_close_rel(grads, want_grads, 1e-10)
        assert_close_rel(params, want_params, 1e-10)


def test_each_rank_holds_its_share_of_the_parameters(fsdp_results):
    whole = sum(p.numel() for p in TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).parameters())
    shards = [res["shard_numel"] for res in fsdp_results]
    assert sum(shards) >= whole and max(shards) <= whole / len(fsdp_results) * 1.15 + 64, (shards, whole)


@pytest.mark.parametrize("kind, level, split, reduce", UPDATE_SCENARIOS)
def test_fsdp_several_updates_equal_as_many_sequential_full_batch_steps(fsdp_results, kind, level, split, reduce):
    """train.updates_per_step, sharded: one step in 2 or 3 updates (the later ones' old logprobs from the
    step's start swapped into the shards, every whole parameter FSDP kept let go) equals that many
    plain full-batch steps in sequence (float64, 1e-10)."""
    rows = rows_for(level, ROW_KINDS[kind]())
    want_grads, want_params = reference_updates(rows, LOSS_VARIANTS[level], update_rows(UPDATE_SPLITS_12[split]))
    for rank, res in enumerate(fsdp_results):
        grads, params, m = res[("updates", kind, level, split, reduce)]
        assert m["train/updates"] == len(UPDATE_SPLITS_12[split]), rank
        assert_close_rel(grads, want_grads, 1e-10)
        assert_close_rel(params, want_params, 1e-10)


def test_fsdp_reward_kl_equals_the_single_process_one(fsdp_results):
    """reward.kl_coef on the sharded reference: every rank's rows (one rank none at all, the others in
    different numbers of passes) get the KL a single unsharded trainer computes."""
    from single_controller.backends.torch.trainer import TrainerCore

    rows = make_rows(NUM_ROWS, 4)
    plain = TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), TRAIN, keep_reference=True)
    want = plain.reward_kl(rows, "k3")
    seen = []
    for res in fsdp_results:
        mine, got = res["reward_kl"]
        assert got == pytest.approx([want[i] for i in mine], rel=1e-12)
        seen += mine
    assert fsdp_results[0]["reward_kl"][0] == [] and len(seen) > 0  # rank 0 ran padding forwards only
