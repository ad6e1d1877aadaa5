"""TrainerCore: split-API state machine, abort (acceptance 2), weight snapshots, and DDP gradient
equivalence on 2 gloo ranks (acceptance 1)."""

import copy
import dataclasses
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from single_controller.algorithm.dp_split import balanced_partition
from single_controller.algorithm.logprobs import pad_right, token_logprobs
from single_controller.algorithm.losses import grpo_loss
from single_controller.backends.common.weights import load_snapshot, pack_weights
from single_controller.backends.torch.model import TinyGPT
from single_controller.backends.torch.trainer import TrainerCore
from single_controller.config.schema import ModelConfig, TrainConfig
from single_controller.data.tasks import TOKENIZER
from single_controller.protocols import TrainerFailed, TrainerStateLost, TrainStepStateError
from single_controller.types import LossConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from free_ports import free_port  # noqa: E402

torch.set_num_threads(1)
SMALL = ModelConfig(d_model=32, n_heads=2, n_layers=2)


def make_rows(n: int, seed: int) -> dict:
    """Random rows with prompt lengths 3..6, response lengths 1..5, some masked-out response tokens."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    V = TOKENIZER.vocab_size
    rows = {"prompt_ids": [], "response_ids": [], "gen_logprobs": [], "response_mask": []}
    for _ in range(n):
        lp, lr = rng.randint(3, 6), rng.randint(1, 5)
        rows["prompt_ids"].append(torch.randint(0, V, (lp,), generator=g))
        rows["response_ids"].append(torch.randint(0, V, (lr,), generator=g))
        rows["gen_logprobs"].append(-torch.rand(lr, generator=g) * 4 - 1.5)  # around log(1/19)
        mask = torch.rand(lr, generator=g) > 0.2
        mask[0] = True
        rows["response_mask"].append(mask)
    rows["advantage"] = torch.randn(n, generator=g)
    return rows


def take(rows: dict, idx) -> dict:
    out = {k: [v[i] for i in idx] for k, v in rows.items() if k != "advantage"}
    out["advantage"] = rows["advantage"][list(idx)] if len(idx) else torch.zeros(0)
    return out


def seq_lengths(rows: dict) -> list[int]:
    return [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])]


TRAIN = dataclasses.replace(TrainConfig(), lr=1e-2, grad_clip=0.05)  # a clip that binds: checks scale-then-clip


def reference_step(rows: dict, level: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Single process, full batch, written out plainly: mean loss over the batch, backward, clip, AdamW."""
    model = TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double()
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN.lr, betas=TRAIN.betas, weight_decay=TRAIN.weight_decay)
    logp, valid = token_logprobs(model, rows["prompt_ids"], rows["response_ids"])
    mask = pad_right(rows["response_mask"], False, torch.bool) & valid
    gen = pad_right([g.double() for g in rows["gen_logprobs"]], 0.0, torch.float64)
    out = grpo_loss(logp, gen, rows["advantage"], mask, LossConfig(level=level))
    n = out.num_tokens if level == "token" else out.num_sequences
    (out.loss_sum / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN.grad_clip)
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def assert_close_rel(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float) -> None:
    for g, w in zip(got, want):
        err = float((g.detach() - w.detach()).norm() / w.norm().clamp(min=1e-30))
        assert err < rtol, f"relative error {err:.2e}"


# --- state machine and abort ----------------------------------------------------------------


def _trainer(train_cfg=TRAIN) -> TrainerCore:
    return TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), train_cfg)


def _state(t: TrainerCore):
    params = [p.detach().clone() for p in t.params]
    opt = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(t.optimizer.state.values())}
    return params, opt, [dict(g, params=None) for g in t.optimizer.param_groups]


def _assert_bit_identical(a, b):
    pa, oa, ga = a
    pb, ob, gb = b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert oa.keys() == ob.keys()
    for i in oa:
        assert oa[i].keys() == ob[i].keys()
        assert all(torch.equal(oa[i][k], ob[i][k]) for k in oa[i])
    assert ga == gb


def test_state_machine_errors():
    t = _trainer()
    rows = make_rows(4, 0)
    with pytest.raises(TrainStepStateError, match="no train step is open"):
        t.train_microbatch(rows)
    with pytest.raises(TrainStepStateError, match="no train step is open"):
        t.finish_train_step(0)
    t.abort_train_step(0)  # no-op with nothing open
    with pytest.raises(TrainStepStateError, match="next step is 0"):
        t.begin_train_step(1, LossConfig())
    t.begin_train_step(0, LossConfig())
    with pytest.raises(TrainStepStateError, match="step 0 is still open"):
        t.begin_train_step(1, LossConfig())
    with pytest.raises(TrainStepStateError, match="is open"):
        t.publish_weights(1)
    t.train_microbatch(rows)
    with pytest.raises(TrainStepStateError, match="the open step is 0"):
        t.finish_train_step(1)
    metrics = t.finish_train_step(0)
    assert metrics["train/tokens"] == sum(int(m.sum()) for m in rows["response_mask"])
    assert metrics["train/sequences"] == 4 and metrics["train/microbatches"] == 1
    with pytest.raises(TrainStepStateError):
        t.finish_train_step(1)
    with pytest.raises(TrainStepStateError, match="next step is 1"):
        t.begin_train_step(0, LossConfig())  # a replayed begin of a finished step is refused
    with pytest.raises(ValueError, match="reference policy"):
        t.begin_train_step(1, LossConfig(kl_coef=0.1))
    with pytest.raises(TrainerFailed, match="no valid tokens"):
        t.begin_train_step(1, LossConfig())
        t.finish_train_step(1)
    t.abort_train_step(1)


def test_repeated_finish_and_late_abort_never_apply_or_undo_a_step():
    """Issue 9, defect 1: a finish retried after its deadline returns the recorded result with no
    second optimizer step, and an abort of a finished step does nothing."""
    t = _trainer()
    t.begin_train_step(0, LossConfig())
    t.train_microbatch(make_rows(6, 1))
    first = t.finish_train_step(0)
    after = _state(t)
    assert t.steps.status() == {"next_step": 1, "open_step": None, "last_finished": 0}
    again = t.finish_train_step(0)  # the retry
    assert again == first
    _assert_bit_identical(_state(t), after)
    t.abort_train_step(0)  # the controller's abort after the deadline: the step stays applied
    _assert_bit_identical(_state(t), after)
    assert (t.statistics().steps_done, t.statistics().aborts) == (1, 0)


def test_abort_restores_params_and_optimizer_bit_identically():
    """Acceptance 2: after a real step (Adam state non-empty), begin + microbatches + abort leaves
    parameters and optimizer state bit-identical; and the next step equals one taken without the abort."""
    t, twin = _trainer(), _trainer()
    for tr in (t, twin):
        tr.begin_train_step(0, LossConfig())
        tr.train_microbatch(make_rows(6, 1))
        tr.finish_train_step(0)
    before = _state(t)
    assert before[1] and all(s for s in before[1].values())  # Adam has exp_avg etc.
    t.begin_train_step(1, LossConfig())
    t.train_microbatch(make_rows(5, 2))
    t.train_microbatch(make_rows(3, 3))
    t.abort_train_step(1)
    _assert_bit_identical(_state(t), before)
    t.abort_train_step(1)  # idempotent
    _assert_bit_identical(_state(t), before)
    assert (t.statistics().steps_done, t.statistics().aborts, t.statistics().open_step) == (1, 1, None)
    # The retried step gives exactly what a trainer that never saw the aborted microbatches gives.
    for tr in (t, twin):
        tr.begin_train_step(1, LossConfig())
        tr.train_microbatch(make_rows(4, 4))
        tr.finish_train_step(1)
    _assert_bit_identical(_state(t), _state(twin))


def test_an_optimizer_step_that_fails_partway_is_refused_until_a_checkpoint_load(monkeypatch):
    """No copy of the weights is kept per step, so an optimizer step that fails after moving them
    cannot be aborted: the rank says so (`TrainerStateLost`) on finish, abort, begin and save, and a
    checkpoint load brings it back."""
    t, twin = _trainer(), _trainer()
    for tr in (t, twin):
        tr.begin_train_step(0, LossConfig())
        tr.train_microbatch(make_rows(6, 1))
        tr.finish_train_step(0)
    saved = copy.deepcopy(t.state_dict())
    t.begin_train_step(1, LossConfig())
    t.train_microbatch(make_rows(6, 5))
    real_step = t.optimizer.step

    def step_then_fail(*a, **k):
        real_step(*a, **k)
        raise RuntimeError("simulated failure after the update")

    monkeypatch.setattr(t.optimizer, "step", step_then_fail)
    with pytest.raises(TrainerStateLost, match=r"optimizer step of step 1 failed partway \(RuntimeError: simulated"):
        t.finish_train_step(1)
    monkeypatch.undo()
    for refused in (lambda: t.abort_train_step(1), lambda: t.begin_train_step(1, LossConfig()), t.state_dict):
        with pytest.raises(TrainerStateLost, match="resume from the last checkpoint"):
            refused()
    t.load_state_dict(saved)
    _assert_bit_identical(_state(t), _state(twin))
    for tr in (t, twin):  # the loaded rank takes step 1 as one that never failed
        tr.begin_train_step(1, LossConfig())
        tr.train_microbatch(make_rows(6, 5))
        tr.finish_train_step(1)
    _assert_bit_identical(_state(t), _state(twin))


def test_a_failed_finish_before_the_optimizer_step_is_aborted_bit_identically():
    """A finish that fails before the optimizer step (here: a non-finite gradient norm) changed
    nothing but gradients: the abort leaves the rank exactly as before the step began."""
    t = _trainer()
    t.begin_train_step(0, LossConfig())
    t.train_microbatch(make_rows(6, 1))
    t.finish_train_step(0)
    before = _state(t)
    t.begin_train_step(1, LossConfig())
    t.train_microbatch(make_rows(6, 5))
    t.params[0].grad.fill_(float("nan"))
    with pytest.raises(TrainerFailed, match="gradient norm is nan"):
        t.finish_train_step(1)
    t.abort_train_step(1)
    _assert_bit_identical(_state(t), before)


def _bad_rows() -> dict:
    rows = make_rows(3, 9)
    rows["gen_logprobs"][1] = rows["gen_logprobs"][1][:0]  # lengths differ: the microbatch raises
    return rows


def test_a_failed_microbatch_leaves_a_step_only_abort_can_close():
    """A finish that arrives after a failed microbatch (pipelined behind it) applies nothing: the
    step's gradients are partial. The step stays open, and an abort restores it bit-identically."""
    t = _trainer()
    before = _state(t)
    t.begin_train_step(0, LossConfig())
    t.train_microbatch(make_rows(6, 1))
    with pytest.raises(ValueError, match="lengths differ"):
        t.train_microbatch(_bad_rows())
    t.train_microbatch(make_rows(4, 2))  # still accepted (it may already be queued), never applied
    with pytest.raises(TrainerFailed, match=r"failed on 1 rank\(s\) \(here: ValueError"):
        t.finish_train_step(0)
    assert t.steps.is_open and t.steps.status()["last_finished"] is None
    with pytest.raises(TrainerFailed, match="partial"):
        t.finish_train_step(0)  # a retried finish too
    t.abort_train_step(0)
    _assert_bit_identical(_state(t), before)
    t.begin_train_step(0, LossConfig())  # the step runs again from the start
    t.train_microbatch(make_rows(6, 1))
    assert t.finish_train_step(0)["train/sequences"] == 6


def test_chunking_does_not_change_the_single_process_step():
    rows = make_rows(10, 7)
    want_grads, want_params = reference_step(rows, "token")
    t = _trainer()
    t.begin_train_step(0, LossConfig())
    for idx in ([0, 1, 2], [], [3], [4, 5, 6, 7, 8, 9]):
        t.train_microbatch(take(rows, idx))
    m = t.finish_train_step(0)
    assert m["train/grad_norm"] > TRAIN.grad_clip  # the clip bound
    # float64, same ops in a different summation order: agreement to ~1e-15; 1e-10 leaves margin.
    assert_close_rel([p.grad for p in t.params], want_grads, 1e-10)
    assert_close_rel(t.params, want_params, 1e-10)


def test_pack_and_load_weights_bit_identical():
    src = TinyGPT(ModelConfig(), TOKENIZER.vocab_size, seed=0)
    dst = TinyGPT(ModelConfig(), TOKENIZER.vocab_size, seed=1)
    snap = pack_weights(src, version=7, bucket_bytes=64 << 10)  # 64 KiB buckets -> several
    m = snap.manifest
    assert m.version == 7 and m.dtype == "float32" and len(snap.buckets) > 2
    assert m.num_bytes == 4 * sum(p.numel() for p in src.parameters())
    assert all(
        b.nbytes <= 64 << 10 or sum(1 for e in m.entries if e.bucket == i) == 1 for i, b in enumerate(snap.buckets)
    )
    load_snapshot(dst, snap)
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))
    with torch.no_grad():
        src.tok_emb.weight.add_(1.0)  # the snapshot is a copy, not a view of live weights
    assert np.array_equal(snap.buckets[0][:5], dst.tok_emb.weight.detach().reshape(-1)[:5].numpy())
    wrong = TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        load_snapshot(wrong, snap)


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
SCENARIOS = [(level, ci) for level in ("token", "sequence") for ci in range(len(CHUNKINGS))]


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = make_rows(NUM_ROWS, 11)
    results = {}
    for level, ci in SCENARIOS:
        core = TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), TRAIN, process_group=dist.group.WORLD)
        core.begin_train_step(0, LossConfig(level=level))
        for chunk in CHUNKINGS[ci]:
            sub = take(rows, chunk)
            mine = balanced_partition(seq_lengths(sub), world)[rank]  # what CpuTrainerGroup does
            core.train_microbatch(take(sub, mine))
        core.finish_train_step(0)
        results[(level, ci)] = ([p.grad.clone() for p in core.params], [p.detach().clone() for p in core.params])
    # Rank 0's microbatch fails, rank 1's does not; both finish: both refuse (no rank applies a
    # step or waits for the other in the gradients' all-reduce), and an abort restores both.
    core = TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), TRAIN, process_group=dist.group.WORLD)
    start = [p.detach().clone() for p in core.params]
    core.begin_train_step(0, LossConfig())
    try:
        core.train_microbatch(_bad_rows() if rank == 0 else make_rows(3, 9))
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


@pytest.mark.parametrize("level, ci", SCENARIOS)
def test_ddp_split_step_equals_full_batch(ddp_results, level, ci):
    """Acceptance 1: 2 gloo ranks, chunking CHUNKINGS[ci] split across ranks by length: the applied
    gradient and the post-step parameters equal a plain single-process full-batch step. float64: the
    only differences are summation orders (~1e-15 relative); 1e-10 is tight and still robust. A wrong
    normalizer (local instead of global N, or a per-microbatch mean) is off by O(1)."""
    want_grads, want_params = reference_step(make_rows(NUM_ROWS, 11), level)
    for rank in range(2):
        grads, params = ddp_results[rank][(level, ci)]
        assert_close_rel(grads, want_grads, 1e-10)
        assert_close_rel(params, want_params, 1e-10)


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
        sys.path.insert(0, "tests")
        from test_torch_trainer import make_rows
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
