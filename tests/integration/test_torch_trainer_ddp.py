"""The torch trainer over 2 gloo ranks (DDP gradient equivalence, acceptance 1: each chunk split across the
ranks by length equals one full-batch step) and, in a fresh process, that it never imports torch._dynamo and
steps exactly like torch's AdamW."""

import dataclasses
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from single_controller.algorithm.dp_split import balanced_partition
from single_controller.backends.common import split_step
from single_controller.backends.torch.model import TinyGPT
from single_controller.backends.torch.trainer import TrainerCore
from single_controller.config.schema import TrainConfig
from single_controller.data.tasks import TOKENIZER
from single_controller.protocols import TrainerFailed
from single_controller.types import LossConfig
from tests.helpers.free_ports import free_port
from tests.helpers.multi_turn_rows import multi_turn_rows
from tests.helpers.trainer_rows import (
    LOSS_VARIANTS,
    SMALL,
    TRAIN,
    UPDATE_SPLITS_12,
    assert_close_rel,
    bad_rows,
    make_rows,
    masked_in,
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


# --- DDP gradient equivalence (acceptance 1) -----------------------------------------------------

NUM_ROWS = 12
_rng = random.Random(1234)


def _random_chunking(n: int) -> list[list[int]]:
    cuts = sorted(_rng.sample(range(1, n), _rng.randint(1, 4)))
    return [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, n])]


CHUNKINGS = [
    [list(range(NUM_ROWS))],  # one chunk
    [[i] for i in range(NUM_ROWS)],  # one row per chunk: a rank gets an empty microbatch each time
    [[0], list(range(1, NUM_ROWS))],
    _random_chunking(NUM_ROWS),
    _random_chunking(NUM_ROWS),
]
# The rows of a step: single-turn (`make_rows`, random prompts) or multi-turn (issue 36: 3 groups of 4 rows
# sharing a prompt, policy blocks between observation blocks that are masked out; `multi_turn_rows`).
ROW_KINDS = {
    "single-turn": lambda: make_rows(NUM_ROWS, 11),
    "multi-turn": lambda: multi_turn_rows(3, 4, 11, TOKENIZER.vocab_size),
}
# Every option of the loss menu (`LOSS_VARIANTS`), every chunking, both kinds of rows.
SCENARIOS = [(kind, level, ci) for kind in ROW_KINDS for level in LOSS_VARIANTS for ci in range(len(CHUNKINGS))]
LEVELS = ("token_mean", "seq_mean_token_mean", "sequence_mask")
# One chunk of the 12 rows (6 per rank) in passes of at most DDP_PASS_BUDGET[kind] tokens: 4 passes on each
# rank, some packing two rows (of the multi-turn rows: on rank 0 two of one prompt, which then runs once);
# with and without gradient checkpointing.
DDP_PASS_BUDGET = {"single-turn": 20, "multi-turn": 32}
PASS_SCENARIOS = [(kind, level, ckpt) for kind in ROW_KINDS for level in LEVELS for ckpt in (False, True)]
# train.updates_per_step: every option of the loss menu in 2 and 3 updates, each in several chunks.
UPDATE_SCENARIOS = [(kind, level, split) for kind in ROW_KINDS for level in LOSS_VARIANTS for split in UPDATE_SPLITS_12]


def _counting_shared_prefix(policy: TinyGPT) -> list[int]:
    """[the number of `forward_shared_prefix` calls of `policy`]: the passes that ran a prompt once for several rows."""
    calls = [0]
    real = policy.forward_shared_prefix

    def counted(*args):
        calls[0] += 1
        return real(*args)

    policy.forward_shared_prefix = counted
    return calls


def _ddp_step(rank: int, world: int, rows: dict, chunking, level: str, cfg: TrainConfig = TRAIN, updates=None) -> tuple:
    """One step of `rows` in `chunking` on this rank, each chunk split across the ranks by length (what
    RankTrainerGroup does), with the loss `LOSS_VARIANTS[level]`: (applied gradient, parameters after,
    metrics, shared-prefix forwards). `updates` (instead of `chunking`): the step's updates' chunkings."""
    policy = TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double()
    loss = LOSS_VARIANTS[level]
    core = TrainerCore(policy, train_config_for(loss, cfg), process_group=dist.group.WORLD)
    shared = _counting_shared_prefix(policy)  # after the trainer copied its KL reference: not into that copy
    core.begin_train_step(0, loss)
    for update, chunks in enumerate(updates or [chunking]):
        for chunk in chunks:
            sub = take(rows, chunk)
            core.train_microbatch(take(sub, balanced_partition(seq_lengths(sub), world)[rank]), update=update)
    m = core.finish_train_step(0)
    return [p.grad.clone() for p in core.params], [p.detach().clone() for p in core.params], m, shared[0]


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    for kind, level, ci in SCENARIOS:
        results[(kind, level, ci)] = _ddp_step(rank, world, rows_for(level, ROW_KINDS[kind]()), CHUNKINGS[ci], level)
    for kind, level, split in UPDATE_SCENARIOS:
        rows = rows_for(level, ROW_KINDS[kind]())
        results[("updates", kind, level, split)] = _ddp_step(
            rank, world, rows, None, level, updates=UPDATE_SPLITS_12[split]
        )
    for kind, level, ckpt in PASS_SCENARIOS:
        cfg = dataclasses.replace(TRAIN, micro_batch_tokens=DDP_PASS_BUDGET[kind], gradient_checkpointing=ckpt)
        results[("passes", kind, level, ckpt)] = _ddp_step(
            rank, world, ROW_KINDS[kind](), [list(range(NUM_ROWS))], level, cfg
        )
    # Rank 0's microbatch fails, rank 1's does not; both finish: both refuse (no rank applies a
    # step or waits for the other in the gradients' all-reduce), and an abort restores both.
    core = TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), TRAIN, process_group=dist.group.WORLD)
    start = [p.detach().clone() for p in core.params]
    core.begin_train_step(0, LossConfig())
    try:
        core.train_microbatch(bad_rows() if rank == 0 else make_rows(3, 9))
    except ValueError:
        pass
    try:
        core.finish_train_step(0)
        results["poisoned"] = "finished"
    except TrainerFailed as e:
        results["poisoned"] = str(e)
    core.abort_train_step(0)
    results["poisoned_restored"] = all(torch.equal(a, b) for a, b in zip(core.params, start))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_ddp_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("kind, level, ci", SCENARIOS)
def test_ddp_split_step_equals_full_batch(ddp_results, kind, level, ci):
    """Acceptance 1 (and acceptance 3 of issue 36 with the multi-turn rows): 2 gloo ranks, chunking
    CHUNKINGS[ci] split across ranks by length: the applied gradient and the post-step parameters equal a
    plain single-process full-batch step, which runs whole rows (no shared prompt). float64: the only
    differences are summation orders (~1e-15 relative); 1e-10 is tight and still robust. A wrong
    normalizer (local instead of global N, or a per-microbatch mean) is off by O(1). The step counts
    exactly the masked-in tokens, over both ranks."""
    rows = rows_for(level, ROW_KINDS[kind]())
    want_grads, want_params = reference_step(rows, LOSS_VARIANTS[level])
    for rank in range(2):
        grads, params, m, shared = ddp_results[rank][(kind, level, ci)]
        assert_close_rel(grads, want_grads, 1e-10)
        assert_close_rel(params, want_params, 1e-10)
        assert (m["train/tokens"], m["train/sequences"]) == reference_counts(rows, LOSS_VARIANTS[level])
        if "mask" not in level:
            assert (m["train/tokens"], m["train/sequences"]) == (masked_in(rows), NUM_ROWS)
        if kind == "multi-turn" and ci == 0:  # 6 rows of 3 prompts on a rank: a prompt ran once for two rows
            assert shared > 0, rank


@pytest.mark.parametrize("kind, level, ckpt", PASS_SCENARIOS)
def test_ddp_token_budget_passes_equal_the_full_batch_step(ddp_results, kind, level, ckpt):
    """2 gloo ranks, each microbatch cut into >= 3 passes by `train.micro_batch_tokens` (with and
    without gradient checkpointing): gradients and parameters equal the full-batch step (1e-10, as above)."""
    rows = ROW_KINDS[kind]()
    want_grads, want_params = reference_step(rows, LOSS_VARIANTS[level])
    shared_passes = 0
    for rank in range(2):
        grads, params, m, shared = ddp_results[rank][("passes", kind, level, ckpt)]
        mine = [seq_lengths(rows)[i] for i in balanced_partition(seq_lengths(rows), 2)[rank]]
        assert m["train/passes"] == len(split_step.token_passes(mine, DDP_PASS_BUDGET[kind])) >= 3
        assert_close_rel(grads, want_grads, 1e-10)
        assert_close_rel(params, want_params, 1e-10)
        assert m["train/tokens"] == reference_counts(rows, LOSS_VARIANTS[level])[0]
        shared_passes += shared
    # gradient checkpointing runs whole rows; else the multi-turn rows' packed pair of one prompt shares it
    assert shared_passes == (1 if kind == "multi-turn" and not ckpt else 0)


def test_ddp_finish_after_a_failed_microbatch_refuses_on_every_rank(ddp_results):
    for rank, res in enumerate(ddp_results):
        assert "a microbatch of the step failed on 1 rank(s)" in res["poisoned"], (rank, res["poisoned"])
        assert ("here: ValueError" in res["poisoned"]) == (rank == 0)
        assert res["poisoned_restored"]


def test_the_trainer_never_imports_dynamo_and_steps_exactly_like_torch_adamw():
    """`eager_optim`: building the optimizer, steps, zero_grad, an abort's state round trip: no
    torch._dynamo import (~1.3 s of CPU per trainer process at start-up), and the same weights as
    torch.optim.AdamW's own step(), bit for bit."""
    import subprocess
    import textwrap

    code = textwrap.dedent(
        """
        import sys, dataclasses, torch
        torch.set_num_threads(1)
        from single_controller.backends.torch.model import TinyGPT
        from single_controller.backends.torch.trainer import TrainerCore
        from single_controller.config.schema import ModelConfig, TrainConfig
        from single_controller.data.tasks import TOKENIZER
        from single_controller.types import LossConfig
        from tests.helpers.trainer_rows import make_rows
        cfg = dataclasses.replace(TrainConfig(), lr=1e-2, weight_decay=0.1)
        t = TrainerCore(TinyGPT(ModelConfig(d_model=32, n_heads=2, n_layers=2), TOKENIZER.vocab_size, seed=0), cfg)
        grads = []
        for step in range(3):
            t.begin_train_step(step, LossConfig())
            t.train_microbatch(make_rows(6, step))
            t.finish_train_step(step)
            grads.append([q.grad.clone() for q in t.params])  # the trainer's own clipped, 1/N-scaled gradient
        t.begin_train_step(3, LossConfig())
        t.abort_train_step(3)
        assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
        plain = TinyGPT(ModelConfig(d_model=32, n_heads=2, n_layers=2), TOKENIZER.vocab_size, seed=0)
        opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        for g in grads:  # torch's own step() on the same gradients
            for p, q in zip(plain.parameters(), g):
                p.grad = q
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), t.params)), "weights differ from torch's AdamW"
        print("ok")
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("kind, level, split", UPDATE_SCENARIOS)
def test_ddp_several_updates_equal_as_many_sequential_full_batch_steps(ddp_results, kind, level, split):
    """train.updates_per_step on 2 gloo ranks: one step in 2 or 3 updates (each chunk split across the
    ranks) equals that many plain full-batch steps in sequence, each later update's ratio against the
    step's start (float64, 1e-10)."""
    rows = rows_for(level, ROW_KINDS[kind]())
    want_grads, want_params = reference_updates(rows, LOSS_VARIANTS[level], update_rows(UPDATE_SPLITS_12[split]))
    for rank in range(2):
        grads, params, m, _ = ddp_results[rank][("updates", kind, level, split)]
        assert m["train/updates"] == len(UPDATE_SPLITS_12[split])
        assert_close_rel(grads, want_grads, 1e-10)
        assert_close_rel(params, want_params, 1e-10)
