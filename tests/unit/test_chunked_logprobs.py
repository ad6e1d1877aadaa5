"""Chunked token log-probabilities (`algorithm/logprobs.py`, issue #54): the float32 log-distribution
of the response tokens is computed a chunk of tokens at a time, forward and backward, and gives what
the whole-tensor formula gave (gather the response positions, log_softmax, gather the targets): the
same values, bit-equal gradients in float64, within 1e-6 in float32, with bfloat16 logits too."""

from __future__ import annotations

import pytest
import torch

from single_controller.algorithm import logprobs
from single_controller.algorithm.logprobs import log_softmax_tempered, token_logprobs_entropy


def _whole(logits, pos, targets, valid, temperature):
    """The formula before chunking: [B, R, V] picked, its whole log-distribution, then the targets."""
    picked = torch.gather(logits, 1, pos[:, :, None].expand(-1, -1, logits.shape[-1]))
    logp = log_softmax_tempered(picked, temperature)
    out = torch.gather(logp, 2, targets[:, :, None]).squeeze(2)
    ent = -(logp.exp() * logp).sum(-1)
    return out.masked_fill(~valid, 0.0), ent.detach().masked_fill(~valid, 0.0)


class _Logits(torch.nn.Module):
    """A 'policy' whose logits are a parameter's rows picked by the token ids (a [V, V] table)."""

    def __init__(self, vocab: int, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter((torch.randn(vocab, vocab, generator=g) * 3).to(dtype))

    def forward(self, ids):
        return self.table[ids]


def _case(dtype, vocab=50, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in (3, 5, 2, 4)]
    responses = [torch.randint(0, vocab, (n,), generator=g) for n in (4, 1, 6, 3)]
    return _Logits(vocab, dtype), prompts, responses


def _positions(prompts, responses):
    lp = torch.tensor([len(p) for p in prompts])
    lr = torch.tensor([len(r) for r in responses])
    R, L = int(lr.max()), int((lp + lr).max())
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, : len(p) + len(r)] = torch.cat([p, r])
    j = torch.arange(R)
    valid = j[None] < lr[:, None]
    pos = (lp[:, None] + j[None] - 1).clamp(max=L - 1)
    targets = torch.gather(ids, 1, (pos + 1).clamp(max=L - 1))
    return ids, pos, targets, valid


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [1, 3, 1000], ids=["1 token", "3 tokens", "one chunk"])
def test_chunked_logprobs_give_the_whole_formulas_values_and_bit_equal_float64_gradients(
    monkeypatch, temperature, chunk_tokens
):
    policy, prompts, responses = _case(torch.float64)
    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 4 * 50 * chunk_tokens)  # chunk_tokens rows of 50 float32s
    ids, pos, targets, valid = _positions(prompts, responses)
    weights = torch.randn(valid.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    want, want_ent = _whole(policy(ids), pos, targets, valid, temperature)
    (want * weights).sum().backward()
    want_grad = policy.table.grad.clone()
    policy.table.grad = None

    got, got_valid, got_ent = token_logprobs_entropy(policy, prompts, responses, temperature)
    (got * weights).sum().backward()
    assert torch.equal(got_valid, valid)
    assert torch.equal(got, want) and torch.equal(got_ent, want_ent)
    assert torch.equal(policy.table.grad, want_grad)  # bit-equal


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-6)])
def test_chunked_logprobs_in_float32_and_bfloat16_logits(monkeypatch, dtype, tol):
    """Upcast per chunk as the whole formula upcasts the whole tensor: float32 results within 1e-6,
    gradients in the logits' dtype within rounding of it."""
    policy, prompts, responses = _case(dtype, seed=3)
    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 4 * 50 * 2)
    ids, pos, targets, valid = _positions(prompts, responses)
    want, _ = _whole(policy(ids), pos, targets, valid, 1.0)
    want.sum().backward()
    want_grad = policy.table.grad.float().clone()
    policy.table.grad = None
    got, _, _ = token_logprobs_entropy(policy, prompts, responses, 1.0)
    got.sum().backward()
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() <= tol
    rounding = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert (policy.table.grad.float() - want_grad).abs().max().item() <= rounding * want_grad.abs().max().item()
