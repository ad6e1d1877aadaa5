"""TrainerCore: split-API state machine, abort (acceptance 2), weight snapshots, and DDP gradient
equivalence on 2 gloo ranks (acceptance 1)."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from single_controller.algorithm.logprobs import token_logprobs
from single_controller.algorithm.schedules import lr_at
from single_controller.backends.common import split_step
from single_controller.backends.common.split_step import lr_schedule
from single_controller.backends.common.weights import load_snapshot, pack_weights
from single_controller.backends.torch.model import TinyGPT
from single_controller.backends.torch.trainer import TrainerCore
from single_controller.config.schema import ModelConfig
from single_controller.data.tasks import TOKENIZER
from single_controller.protocols import TrainerFailed, TrainerStateLost, TrainStepStateError
from single_controller.types import NO_LOSS, LossConfig
from tests.helpers.multi_turn_rows import multi_turn_rows
from tests.helpers.trainer_rows import (
    LOSS_VARIANTS,
    SMALL,
    TRAIN,
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
)

torch.set_num_threads(1)


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


def test_a_failed_microbatch_leaves_a_step_only_abort_can_close():
    """A finish that arrives after a failed microbatch (pipelined behind it) applies nothing: the
    step's gradients are partial. The step stays open, and an abort restores it bit-identically."""
    t = _trainer()
    before = _state(t)
    t.begin_train_step(0, LossConfig())
    t.train_microbatch(make_rows(6, 1))
    with pytest.raises(ValueError, match="lengths differ"):
        t.train_microbatch(bad_rows())
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


@pytest.mark.parametrize("variant", LOSS_VARIANTS)
def test_chunking_does_not_change_the_single_process_step(variant):
    """Every option of the loss menu: microbatches of 3, 0, 1 and 6 rows give the full-batch step."""
    rows, loss = rows_for(variant, make_rows(10, 7)), LOSS_VARIANTS[variant]
    want_grads, want_params = reference_step(rows, loss)
    t = _trainer(train_config_for(loss))
    t.begin_train_step(0, loss)
    for idx in ([0, 1, 2], [], [3], [4, 5, 6, 7, 8, 9]):
        t.train_microbatch(take(rows, idx))
    m = t.finish_train_step(0)
    assert (m["train/tokens"], m["train/sequences"]) == reference_counts(rows, loss)
    assert m["train/grad_norm"] > TRAIN.grad_clip  # the clip bound
    # float64, same ops in a different summation order: agreement to ~1e-15; 1e-10 leaves margin.
    assert_close_rel([p.grad for p in t.params], want_grads, 1e-10)
    assert_close_rel(t.params, want_params, 1e-10)


# --- multi-turn rows (issue 36): only policy tokens train -----------------------------------------


def _step_of(rows: dict, level: str) -> tuple[list[torch.Tensor], list, dict]:
    """(applied gradient, parameters after, metrics) of one step of `rows` in two microbatches."""
    t = _trainer()
    t.begin_train_step(0, LOSS_VARIANTS[level])
    t.train_microbatch(take(rows, range(5)))
    t.train_microbatch(take(rows, range(5, len(rows["prompt_ids"]))))
    m = t.finish_train_step(0)
    return [p.grad.clone() for p in t.params], [p.detach().clone() for p in t.params], m


def _without_timing(m: dict) -> dict:
    return {k: v for k, v in m.items() if k != "train/step_s"}


@pytest.mark.parametrize("level", ["token_mean", "seq_mean_token_mean"])
def test_observation_tokens_are_context_only_and_the_step_counts_only_policy_tokens(level):
    """Multi-turn rows: the gen_logprobs and token_versions of observation tokens (masked out) and the ids of
    a trailing observation block (nothing after it reads them) change nothing, bit for bit: gradients,
    parameters, every metric. A trainer that trained on observation tokens would see the garbage
    logprobs. `train/tokens` is the number of policy tokens, and every row, its observations at version -1
    or at its policy tokens' version, counts as sampled with this step's weights (`train/mismatch_tokens`).
    Control: an observation token in the middle of a row is context for the policy tokens after it, so
    changing its id does change the step."""
    rows = multi_turn_rows(3, 4, 5, TOKENIZER.vocab_size)
    masks = rows["response_mask"]
    policy_tokens = masked_in(rows)
    assert policy_tokens < sum(len(r) for r in rows["response_ids"])
    assert any(bool((v[~m] == -1).any()) for v, m in zip(rows["token_versions"], masks))
    assert any(bool((v[~m] == 0).any()) for v, m in zip(rows["token_versions"], masks))
    grads, params, m = _step_of(rows, level)
    assert (m["train/tokens"], m["train/sequences"], m["train/mismatch_tokens"]) == (policy_tokens, 12, policy_tokens)

    g = torch.Generator().manual_seed(6)
    garbage = copy.deepcopy(rows)
    for i, mask in enumerate(masks):
        obs = ~mask
        garbage["gen_logprobs"][i] = torch.where(obs, torch.randn(len(mask), generator=g) * 20, rows["gen_logprobs"][i])
        garbage["token_versions"][i] = torch.where(obs, -1 - rows["token_versions"][i], rows["token_versions"][i])
        tail = len(mask) - int(mask.nonzero().max()) - 1  # the trailing observation block
        if tail:
            garbage["response_ids"][i][-tail:] = (rows["response_ids"][i][-tail:] + 1) % TOKENIZER.vocab_size
    garbage["gen_logprobs"][0][(~masks[0]).nonzero()[0]] = float("nan")
    assert sum(not torch.equal(a, b) for a, b in zip(rows["response_ids"], garbage["response_ids"])) >= 3
    g2, p2, m2 = _step_of(garbage, level)
    assert all(torch.equal(a, b) for a, b in zip(grads, g2)) and all(torch.equal(a, b) for a, b in zip(params, p2))
    assert _without_timing(m2) == _without_timing(m)

    context = copy.deepcopy(rows)
    first_obs = int((~masks[3]).nonzero()[0])  # followed by a policy block: a row starts with one, obs between
    context["response_ids"][3][first_obs] = (rows["response_ids"][3][first_obs] + 1) % TOKENIZER.vocab_size
    g3, _, m3 = _step_of(context, level)
    assert m3["train/tokens"] == policy_tokens and m3["train/loss"] != m["train/loss"]
    assert not all(torch.equal(a, b) for a, b in zip(grads, g3))


def test_a_mask_bit_flipped_onto_an_observation_token_trains_that_token():
    """The mask is what decides: one observation token's bit set to True adds that token to `train/tokens`
    and to the loss, and the step then equals the full-batch reference of the flipped rows, not of the
    original ones (a trainer that ignored the mask would match both or neither)."""
    rows = multi_turn_rows(3, 4, 5, TOKENIZER.vocab_size)
    flipped = copy.deepcopy(rows)
    obs = int((~rows["response_mask"][2]).nonzero()[0])
    flipped["response_mask"][2][obs] = True
    flipped["gen_logprobs"][2][obs] = -2.0  # a policy token carries its logprob
    want_grads, _ = reference_step(rows, LOSS_VARIANTS["token_mean"])
    flip_grads, flip_params = reference_step(flipped, LOSS_VARIANTS["token_mean"])
    grads, params, m = _step_of(flipped, "token_mean")
    assert m["train/tokens"] == masked_in(rows) + 1
    assert_close_rel(grads, flip_grads, 1e-10)
    assert_close_rel(params, flip_params, 1e-10)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close_rel(grads, want_grads, 1e-3)


def test_mismatch_counts_rows_sampled_entirely_with_the_steps_weights_whatever_their_observation_versions():
    """Step 1 on multi-turn rows whose policy tokens are at version 1, but for a few rows whose first turn
    was sampled at version 0 (an episode continued across a `keep` sync): `train/mismatch_*` cover exactly
    the policy tokens of the rows entirely at version 1, with observations at -1 or 1, and equal the
    logprob gap computed by hand from the weights the step starts from."""
    t = _trainer()
    t.begin_train_step(0, LossConfig())
    t.train_microbatch(make_rows(6, 1))
    t.finish_train_step(0)
    rows = multi_turn_rows(3, 4, 8, TOKENIZER.vocab_size, version=1)
    for i in (1, 4, 7):  # the first policy block at version 0
        mask, versions = rows["response_mask"][i], rows["token_versions"][i]
        first_obs = int((~mask).nonzero()[0])
        versions[:first_obs] = 0
    fresh = [i for i in range(12) if i not in (1, 4, 7)]
    with torch.no_grad():
        logp, _ = token_logprobs(t.policy, rows["prompt_ids"], rows["response_ids"])
    gap = [
        (logp[i, : len(rows["response_ids"][i])] - rows["gen_logprobs"][i].double())[rows["response_mask"][i]]
        for i in fresh
    ]
    t.begin_train_step(1, LossConfig())
    t.train_microbatch(rows)
    m = t.finish_train_step(1)
    assert m["train/tokens"] == masked_in(rows)
    assert m["train/mismatch_tokens"] == sum(len(d) for d in gap) < m["train/tokens"]
    want = float(torch.cat(gap).abs().mean())
    assert m["train/mismatch_abs_logprob"] == pytest.approx(want, rel=1e-10)


PASS_CHUNKS = ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9])  # of make_rows(10, 7), lengths 7 7 8 | 6 8 5 7 | 7 5 7
PASS_BUDGET = 12  # tokens per pass: 3 passes per chunk, rows 3 and 6 of the second (5 + 7 -> 2 x 7) in one


def _counting_forwards(modules) -> list[int]:
    """[the number of forward calls of `modules`], counted as they start (a recompute may stop early)."""
    calls = [0]
    for m in modules:
        m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored-activations", "gradient-checkpointing"])
@pytest.mark.parametrize("level", ["token_mean", "seq_mean_token_mean", "gspo", "sequence_mask"])
def test_token_budget_passes_and_checkpointing_do_not_change_the_single_process_step(level, checkpointing):
    """`train.micro_batch_tokens` cuts every chunk into >= 3 forward/backward passes (one packing two
    rows), `train.gradient_checkpointing` recomputes every block in backward: the applied gradient and
    the parameters after the step still equal the plain full-batch step (float64, 1e-10 as above)."""
    rows = make_rows(10, 7)
    lengths = seq_lengths(rows)
    passes = [split_step.token_passes([lengths[i] for i in c], PASS_BUDGET) for c in PASS_CHUNKS]
    assert all(len(p) >= 3 for p in passes) and any(len(x) > 1 for p in passes for x in p)
    want_grads, want_params = reference_step(rows, LOSS_VARIANTS[level])
    cfg = dataclasses.replace(TRAIN, micro_batch_tokens=PASS_BUDGET, gradient_checkpointing=checkpointing)
    t = _trainer(cfg)
    calls = _counting_forwards(t.policy.blocks)
    t.begin_train_step(0, LOSS_VARIANTS[level])
    for idx in PASS_CHUNKS:
        t.train_microbatch(take(rows, idx))
    m = t.finish_train_step(0)
    n_passes = sum(len(p) for p in passes)
    assert m["train/passes"] == n_passes and m["train/microbatches"] == len(PASS_CHUNKS)
    # every block runs once per pass, and once more in its backward when its activations were not kept
    assert calls[0] == n_passes * SMALL.n_layers * (2 if checkpointing else 1)
    assert_close_rel([p.grad for p in t.params], want_grads, 1e-10)
    assert_close_rel(t.params, want_params, 1e-10)


def test_token_passes_pack_rows_longest_first_within_the_budget():
    # lengths 5 9 3 9 4, budget 18: longest first 9 9 | 5 4 3 -> [1, 3] (2 x 9 = 18), [0, 4, 2] (3 x 5 = 15)
    assert split_step.token_passes([5, 9, 3, 9, 4], 18) == [[1, 3], [0, 4, 2]]
    assert split_step.token_passes([5, 30, 3], 18) == [[1], [0, 2]]  # a row over the budget runs alone
    assert split_step.token_passes([5, 9, 3], None) == [[0, 1, 2]]  # no budget: one pass, rows in order
    assert split_step.token_passes([], 18) == []


def test_gradient_checkpointing_of_a_hugging_face_model_recomputes_its_layers_with_the_same_gradients(tmp_path):
    """HF models checkpoint a layer only in training mode: the trainer sets the layers' own flag (no
    dropout below them) and every decoder layer then runs twice per pass, with the same gradients."""
    from single_controller.backends.torch.model import load_hf_policy
    from single_controller.data.hf_model import init_model

    model_dir = init_model(tmp_path / "llama", hidden_size=32, num_layers=2, head_dim=16)
    rows = make_rows(6, 3)
    out = {}
    for checkpointing in (False, True):
        policy = load_hf_policy(model_dir, dtype=torch.float64)
        calls = _counting_forwards(policy.model.model.layers)
        cfg = dataclasses.replace(
            TRAIN, micro_batch_tokens=20, gradient_checkpointing=checkpointing, share_prompt_prefix=False
        )  # one forward of whole rows per pass (shared prefixes are two)
        t = TrainerCore(policy, cfg)
        t.begin_train_step(0, LossConfig())
        t.train_microbatch(rows)
        m = t.finish_train_step(0)
        assert calls[0] == m["train/passes"] * 2 * (2 if checkpointing else 1), (checkpointing, calls, m)
        assert not any(mod.training for mod in policy.model.modules() if isinstance(mod, torch.nn.Dropout))
        out[checkpointing] = [p.grad.clone() for p in t.params]
    assert m["train/passes"] >= 3
    assert_close_rel(out[True], out[False], 1e-12)


COSINE = dataclasses.replace(TRAIN, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
LR_STEPS = 6


def _lr_step(t: TrainerCore, step: int) -> dict[str, float]:
    t.begin_train_step(step, LossConfig())
    t.train_microbatch(make_rows(6, 100 + step))
    return t.finish_train_step(step)


def test_each_optimizer_step_uses_the_scheduled_lr_and_reports_it():
    """Step s runs AdamW at `lr_at(s)` and reports it as `train/lr`: the weights equal torch's own
    AdamW stepped on the same gradients with that lr set by hand. An aborted step leaves the lr (and
    everything else) as it was: the lr is set right before the optimizer step."""
    with pytest.raises(ValueError, match="cosine lr schedule decays over the run's max_steps.*got None"):
        _trainer(COSINE)  # no max_steps: a decaying schedule has no horizon
    t = TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), COSINE, max_steps=LR_STEPS)
    schedule = lr_schedule(COSINE, LR_STEPS)
    plain = TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double()
    opt = torch.optim.AdamW(plain.parameters(), lr=1.0, betas=TRAIN.betas, weight_decay=TRAIN.weight_decay)
    lrs = []
    for step in range(LR_STEPS):
        before = _state(t)
        t.begin_train_step(step, LossConfig())
        t.train_microbatch(make_rows(4, 50 + step))
        t.abort_train_step(step)
        _assert_bit_identical(_state(t), before)
        m = _lr_step(t, step)
        lrs.append(m["train/lr"])
        assert m["train/lr"] == t.optimizer.param_groups[0]["lr"] == lr_at(step, schedule)
        for p, q in zip(plain.parameters(), t.params):
            p.grad = q.grad.clone()  # the clipped, 1/N-scaled gradient the trainer applied
        opt.param_groups[0]["lr"] = lr_at(step, schedule)
        opt.step()
        assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), t.params)), step
    assert lrs[0] == pytest.approx(COSINE.lr / 2) and lrs[-1] == pytest.approx(0.1 * COSINE.lr)  # warmup .. floor


def test_a_trainer_resumed_from_its_state_continues_the_lr_schedule_of_an_uninterrupted_one():
    """A trainer built fresh (a new process) and loaded from the state saved after step 2 trains steps
    3.. with the lrs and weights of the trainer that never stopped: the lr follows the step id."""
    whole = TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), COSINE, max_steps=LR_STEPS)
    want = [_lr_step(whole, s)["train/lr"] for s in range(LR_STEPS)]
    first = TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), COSINE, max_steps=LR_STEPS)
    got = [_lr_step(first, s)["train/lr"] for s in range(3)]
    saved = copy.deepcopy(first.state_dict())
    resumed = TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=1).double(), COSINE, max_steps=LR_STEPS)
    resumed.load_state_dict(saved)
    got += [_lr_step(resumed, s)["train/lr"] for s in range(3, LR_STEPS)]
    assert got == want and len(set(want)) >= 4  # the schedule moves, and the resumed run follows it exactly
    _assert_bit_identical(_state(resumed), _state(whole))


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


# --- offload (`train.offload`, colocated turns) ------------------------------------------------------


def _resident(t: TrainerCore) -> int:
    tensors = [*t.policy.parameters(), *(v for s in t.optimizer.state.values() for v in s.values())]
    return sum(x.untyped_storage().nbytes() for x in tensors)


@pytest.mark.parametrize("what", ["optimizer", "all"])
def test_offload_frees_the_state_and_the_round_trip_is_bit_exact_and_trains_like_a_trainer_never_offloaded(what):
    t, twin = _trainer(dataclasses.replace(TRAIN, kl_coef=0.1)), _trainer(dataclasses.replace(TRAIN, kl_coef=0.1))
    for tr in (t, twin):
        tr.begin_train_step(0, LossConfig())
        tr.train_microbatch(make_rows(6, 1))
        tr.finish_train_step(0)
    before, resident = _state(t), _resident(t)
    params = sum(p.untyped_storage().nbytes() for p in t.policy.parameters())
    moved = t.offload(what)
    opt_bytes = resident - params
    assert moved.num_bytes == (opt_bytes if what == "optimizer" else resident + params)  # + the KL reference's
    assert _resident(t) == (params if what == "optimizer" else 0)  # the memory is gone, not copied
    t.begin_train_step(1, LossConfig())  # needs the state: brings it back itself
    assert t.implicit_onloads == 1 and _resident(t) == resident
    with pytest.raises(TrainStepStateError):  # only between steps
        t.offload(what)
    t.abort_train_step(1)
    assert t.onload().num_bytes == 0  # nothing out: a no-op
    t.offload(what)
    back = t.onload()
    assert back.num_bytes == moved.num_bytes and _resident(t) == resident and not t.host.offloaded
    _assert_bit_identical(_state(t), before)
    for tr in (t, twin):  # the next step is the one a trainer that never offloaded takes
        tr.begin_train_step(1, LossConfig())
        tr.train_microbatch(make_rows(4, 4))
        tr.finish_train_step(1)
    _assert_bit_identical(_state(t), _state(twin))
    assert t.implicit_onloads == 1


def test_a_step_whose_every_row_carries_no_loss_applies_a_zero_gradient():
    """train.mask_truncated: when every row of a step was cut short, the step is not an error (it
    trained nothing): zero gradient, parameters unchanged, every token reported as masked."""
    rows = make_rows(4, 3)
    rows["advantage"] = torch.full((4,), NO_LOSS, dtype=torch.float64)
    t = _trainer()
    before = [p.detach().clone() for p in t.params]
    t.begin_train_step(0, LossConfig())
    t.train_microbatch(rows)
    m = t.finish_train_step(0)
    assert m["train/tokens"] == 0 and m["train/truncated_masked_frac"] == 1.0 and m["train/grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(t.params, before))


# train.updates_per_step: a step's rows in updates (row indices), each update sent in chunks
UPDATE_SPLITS = {
    "2 updates": [[[0, 1], [2, 3, 4]], [[5], [6, 7, 8, 9]]],
    "3 updates": [[[0, 1, 2]], [[3], [], [4, 5, 6]], [[7, 8, 9]]],
}


@pytest.mark.parametrize("split", UPDATE_SPLITS)
@pytest.mark.parametrize("variant", LOSS_VARIANTS)
def test_several_updates_equal_as_many_sequential_full_batch_steps(variant, split):
    """train.updates_per_step: one split-API step whose chunks carry updates 0..M-1 equals M
    sequential full-batch steps, each later update's ratio taken against the policy at the step's
    start (every option of the loss menu, float64, 1e-10)."""
    rows, loss = rows_for(variant, make_rows(10, 7)), LOSS_VARIANTS[variant]
    updates = UPDATE_SPLITS[split]
    want_grads, want_params = reference_updates(rows, loss, [sum(u, []) for u in updates])
    t = _trainer(train_config_for(loss))
    t.begin_train_step(0, loss)
    for j, chunks in enumerate(updates):
        for idx in chunks:
            t.train_microbatch(take(rows, idx), update=j)
    m = t.finish_train_step(0)
    assert m["train/updates"] == len(updates)
    assert m["train/sequences"] == sum(reference_counts(take(rows, sum(u, [])), loss)[1] for u in updates)
    assert_close_rel([p.grad for p in t.params], want_grads, 1e-10)
    assert_close_rel(t.params, want_params, 1e-10)


def test_an_abort_after_updates_were_applied_restores_the_steps_start_bit_exactly():
    """An abort of a step of several updates, after one was applied: parameters and AdamW state
    exactly as before the begin; the step then runs again to the same result as if never aborted."""
    t = _trainer()
    t.begin_train_step(0, LossConfig())
    t.train_microbatch(make_rows(6, 1))
    t.finish_train_step(0)  # AdamW has state: the restore must put it back, not clear it
    before = _state(t)
    t.begin_train_step(1, LossConfig())
    t.train_microbatch(make_rows(4, 2), update=0)
    t.train_microbatch(make_rows(4, 3), update=1)  # update 0 applied here
    assert not all(torch.equal(a, b) for a, b in zip(t.params, before[0]))
    with pytest.raises(TrainStepStateError, match="in order"):
        t.train_microbatch(make_rows(2, 4), update=0)
    t.abort_train_step(1)
    _assert_bit_identical(_state(t), before)
    t.begin_train_step(1, LossConfig())
    t.train_microbatch(make_rows(4, 2), update=0)
    t.train_microbatch(make_rows(4, 3), update=1)
    again = t.finish_train_step(1)
    u = _trainer()
    for step, parts in enumerate([[make_rows(6, 1)], [make_rows(4, 2), make_rows(4, 3)]]):
        u.begin_train_step(step, LossConfig())
        for j, rows in enumerate(parts):
            u.train_microbatch(rows, update=j)
        m = u.finish_train_step(step)
    assert all(torch.equal(a, b) for a, b in zip(t.params, u.params)) and again["train/loss"] == m["train/loss"]


def test_reward_kl_is_each_rows_kl_of_the_sampler_to_the_initial_policy():
    """reward.kl_coef: `reward_kl` is, per row, the sum over its policy tokens of the estimator of
    KL(pi_gen || pi_ref) with the initial policy as pi_ref (written out here), whatever was trained
    since and however the rows are cut into passes; a trainer without a reference refuses."""
    rows = make_rows(6, 2)
    model = TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double()
    want = []
    with torch.no_grad():
        for p, r, g, m in zip(rows["prompt_ids"], rows["response_ids"], rows["gen_logprobs"], rows["response_mask"]):
            logits = model(torch.cat([p, r])[None])[0, len(p) - 1 : -1].double()
            ref = torch.log_softmax(logits, -1).gather(1, r[:, None])[:, 0]
            d = (ref - g.double())[m]
            want.append(float((torch.exp(d) - d - 1).sum()))
    t = _trainer(dataclasses.replace(TRAIN, micro_batch_tokens=16))
    with pytest.raises(ValueError, match="no reference"):
        t.reward_kl(rows, "k3")
    t = TrainerCore(TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double(), TRAIN, keep_reference=True)
    t.begin_train_step(0, LossConfig())
    t.train_microbatch(make_rows(6, 1))
    t.finish_train_step(0)  # the policy moved; the reference did not
    assert t.reward_kl(rows, "k3") == pytest.approx(want, rel=1e-12)
    t.cfg = dataclasses.replace(TRAIN, micro_batch_tokens=12)  # passes of at most 12 tokens
    assert t.reward_kl(rows, "k3") == pytest.approx(want, rel=1e-12)
