"""Random training rows for the torch trainer tests (unit and the 2-rank DDP ones) and the plain single-process
full-batch step they are compared with. Not a test module."""

import dataclasses
import random

import torch

from single_controller.algorithm.logprobs import pad_right, token_logprobs
from single_controller.algorithm.losses import grpo_loss
from single_controller.backends.torch.model import TinyGPT
from single_controller.config.schema import ModelConfig, TrainConfig
from single_controller.data.tasks import TOKENIZER
from single_controller.types import LossConfig

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


def bad_rows() -> dict:
    rows = make_rows(3, 9)
    rows["gen_logprobs"][1] = rows["gen_logprobs"][1][:0]  # lengths differ: the microbatch raises
    return rows
