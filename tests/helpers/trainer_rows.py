"""Random training rows for the torch trainer tests (unit and the 2-rank DDP ones) and the plain single-process
full-batch step they are compared with. Not a test module."""

import copy
import dataclasses
import math
import random

import torch

from single_controller.algorithm.logprobs import pad_right, token_logprobs
from single_controller.algorithm.losses import grpo_loss, loss_normalizer
from single_controller.backends.torch.model import TinyGPT
from single_controller.config.schema import ModelConfig, TrainConfig
from single_controller.data.tasks import TOKENIZER
from single_controller.types import NO_LOSS, LossConfig

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


def masked_in(rows: dict) -> int:
    """The number of masked-in (policy) tokens of `rows`."""
    return sum(int(m.sum()) for m in rows["response_mask"])


def seq_lengths(rows: dict) -> list[int]:
    return [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])]


TRAIN = dataclasses.replace(TrainConfig(), lr=1e-2, grad_clip=0.05)  # a clip that binds: checks scale-then-clip
TRAIN_KL = dataclasses.replace(TRAIN, kl_coef=0.05)  # a trainer that keeps a reference policy

# Every option of the loss menu (`algorithm/losses.py`), each once. With the default ratio (against the step's
# own start, 1 in value) no clip binds, so the clipping losses take theirs against the generation logprobs; the
# random rows' rho spans about [0.1, 4] per token, so the masks keep some tokens and rows and drop others.
LOSS_VARIANTS: dict[str, LossConfig] = {
    "token_mean": LossConfig(),
    "seq_mean_token_mean": LossConfig(agg="seq_mean_token_mean"),
    "seq_mean_token_sum": LossConfig(agg="seq_mean_token_sum"),
    "seq_mean_token_sum_norm": LossConfig(agg="seq_mean_token_sum_norm", norm_tokens=8),
    "clip_higher": LossConfig(clip_low=0.1, clip_high=0.3, is_correction="none", ratio_to_gen=True),
    "gspo": LossConfig(policy_loss="gspo", agg="seq_mean_token_mean", is_correction="none", ratio_to_gen=True),
    "cispo": LossConfig(policy_loss="cispo", clip_low=0.5, clip_high=0.3, is_correction="none", ratio_to_gen=True),
    "no_correction": LossConfig(is_correction="none"),
    "token_mask": LossConfig(is_correction="token_mask", is_low=0.5, is_high=2.0),
    "sequence_truncate": LossConfig(is_correction="sequence_truncate", is_high=2.0),
    "sequence_mask": LossConfig(is_correction="sequence_mask", is_low=0.1, is_high=10.0),
    "kl_k1": LossConfig(kl_coef=0.05, kl_estimator="k1"),
    "kl_k3": LossConfig(kl_coef=0.05, kl_estimator="k3"),
    # train.mask_truncated: the loss is the default; `rows_for` gives some rows no loss (NO_LOSS advantages)
    "mask_truncated": LossConfig(),
}
NO_LOSS_ROWS = (1, 5)  # the rows `rows_for` marks in the mask_truncated variant


# train.updates_per_step over 12 rows: updates (in order), each a list of chunks (row indices)
UPDATE_SPLITS_12 = {
    "2 updates": [[[0, 1], [2, 3, 4, 5]], [[6], [7], [8, 9, 10, 11]]],
    "3 updates": [[[0, 1, 2, 3]], [[4], [5, 6, 7]], [[8, 9, 10, 11]]],
}


def update_rows(updates) -> list[list[int]]:
    """The rows of each update of `updates` (each a list of chunks)."""
    return [[i for chunk in update for i in chunk] for update in updates]


def rows_for(variant: str, rows: dict) -> dict:
    """`rows` as the variant trains them: for `mask_truncated`, rows NO_LOSS_ROWS carry no loss."""
    if variant != "mask_truncated":
        return rows
    adv = rows["advantage"].clone()
    adv[list(NO_LOSS_ROWS)] = NO_LOSS
    return {**rows, "advantage": adv}


def _with_loss(rows: dict) -> dict:
    """The rows of `rows` that carry a loss (a NO_LOSS advantage: none), as the plain full batch sees them."""
    return take(rows, [i for i, a in enumerate(rows["advantage"].tolist()) if not math.isnan(a)])


def train_config_for(loss: LossConfig, base: TrainConfig = TRAIN) -> TrainConfig:
    """`base`, keeping a reference policy when `loss` has a KL penalty."""
    return dataclasses.replace(base, kl_coef=loss.kl_coef) if loss.kl_coef > 0 else base


def reference_step(rows: dict, loss: LossConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Single process, full batch, written out plainly: mean loss over the batch, backward, clip, AdamW.
    The KL reference is the initial model, so its logprobs are the step's own, detached. Rows without
    loss (NO_LOSS) are left out of the batch."""
    kept = _with_loss(rows)
    assert reference_counts(rows, loss)[0] > 0, "a variant must keep some tokens"
    assert reference_counts(rows, loss)[0] < masked_in(kept) or "mask" not in loss.is_correction
    return reference_updates(rows, loss, [range(len(rows["prompt_ids"]))])


def reference_updates(rows: dict, loss: LossConfig, updates) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`train.updates_per_step`, written out plainly: one full-batch step (as `reference_step`) of each of
    `updates` (row indices) in turn, each update's ratio taken against the model as it was before the
    first (its logprobs from a frozen copy) unless the loss takes it against the generation. Returns
    the last update's applied gradient and the parameters after the last."""
    model = TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double()
    start = copy.deepcopy(model).requires_grad_(False)  # the step's start, and the KL reference
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN.lr, betas=TRAIN.betas, weight_decay=TRAIN.weight_decay)
    for j, idx in enumerate(updates):
        part = _with_loss(take(rows, list(idx)))
        logp, valid = token_logprobs(model, part["prompt_ids"], part["response_ids"])
        with torch.no_grad():
            at_start, _ = token_logprobs(start, part["prompt_ids"], part["response_ids"])
        mask = pad_right(part["response_mask"], False, torch.bool) & valid
        gen = pad_right([g.double() for g in part["gen_logprobs"]], 0.0, torch.float64)
        old = at_start if j > 0 and not loss.ratio_to_gen else None
        ref = at_start if loss.kl_coef > 0 else None
        out = grpo_loss(logp, gen, part["advantage"], mask, loss, old_logprobs=old, ref_logprobs=ref)
        n = loss_normalizer(loss, out.num_tokens, out.num_sequences)
        opt.zero_grad(set_to_none=True)
        (out.loss_sum / (n if n > 0 else 1.0)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN.grad_clip)
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def reference_counts(rows: dict, loss: LossConfig) -> tuple[int, int]:
    """(kept tokens, kept sequences) of `rows`' full-batch step under `loss`."""
    rows = _with_loss(rows)
    model = TinyGPT(SMALL, TOKENIZER.vocab_size, seed=0).double()
    with torch.no_grad():
        logp, valid = token_logprobs(model, rows["prompt_ids"], rows["response_ids"])
    mask = pad_right(rows["response_mask"], False, torch.bool) & valid
    gen = pad_right([g.double() for g in rows["gen_logprobs"]], 0.0, torch.float64)
    out = grpo_loss(logp, gen, rows["advantage"], mask, loss, ref_logprobs=logp if loss.kl_coef > 0 else None)
    return out.num_tokens, out.num_sequences


def assert_close_rel(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float) -> None:
    for g, w in zip(got, want):
        err = float((g.detach() - w.detach()).norm() / w.norm().clamp(min=1e-30))
        assert err < rtol, f"relative error {err:.2e}"


def bad_rows() -> dict:
    rows = make_rows(3, 9)
    rows["gen_logprobs"][1] = rows["gen_logprobs"][1][:0]  # lengths differ: the microbatch raises
    return rows
