"""Log-probabilities of given tokens under a causal policy: the one formula every trainer backend
(torch, Megatron) and the torch sampler use, so generation and training logprobs agree.

* `log_softmax_tempered(logits, temperature)`: the policy's log-distribution at a temperature.
* `token_logprobs(policy, prompts, responses, temperature)`: logprobs [B, R] of each response
  token given its prompt and the tokens before it, with the validity mask [B, R]. `policy` is any
  callable module mapping input ids [B, L] to logits [B, L, V] (a DDP wrapper, a Megatron adapter).
* `pad_right(rows, value, dtype)`: 1-D rows of any lengths stacked into [B, max_len].

Pure torch: no engine, no Ray, no asyncio.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LogitsPolicy(Protocol):
    """What `token_logprobs` needs of a policy: an `nn.Module`, a DDP wrapper, a Megatron adapter."""

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...


def pad_right(
    rows: Sequence[torch.Tensor], value: float | int | bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Stack 1-D tensors of any lengths (one dtype) into [B, max_len], padded on the right with
    `value`, then cast to `dtype` if given."""
    if not rows:
        return torch.zeros(0, 0, dtype=dtype or torch.float32)
    out = _pad_flat(torch.cat(list(rows)), [r.shape[0] for r in rows], value)
    return out if dtype is None else out.to(dtype)


def _pad_flat(flat: torch.Tensor, lengths: Sequence[int], value: float | int | bool) -> torch.Tensor:
    """Rows laid end to end in `flat` (row b has `lengths[b]` elements) -> [B, max_len], padded on
    the right with `value`: one masked write. A microbatch has hundreds of short rows, and anything
    done per row in torch (a `pad_sequence`, a `cat`) costs microseconds each: this is ~4x faster
    than padding row by row at 64 rows."""
    n = torch.tensor(lengths, dtype=torch.long, device=flat.device)
    width = int(n.max()) if len(lengths) else 0
    out = torch.full((len(lengths), width), value, dtype=flat.dtype, device=flat.device)
    out[torch.arange(width, device=flat.device)[None, :] < n[:, None]] = flat  # row-major: the rows in order
    return out


def log_softmax_tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The policy's log-distribution at `temperature`; the only formula sampling and training use."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)


def token_logprobs(
    policy: LogitsPolicy,
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of each response token given its prompt and the response tokens before it.

    Returns (logprobs [B, R], valid [B, R]) with R the longest response; `valid` is False on padding.
    The distribution is log_softmax(logits / temperature), exactly as `sampling.sample` reports it.
    `policy` may be a DDP wrapper: it is only called, never inspected.
    """
    device = next(policy.parameters()).device  # rows arrive on the CPU; the policy may be on a GPU
    n_prompt = [p.shape[0] for p in prompt_ids]
    n_response = [r.shape[0] for r in response_ids]
    if min(n_prompt, default=1) < 1:
        raise ValueError("every row needs at least one prompt token")
    lp = torch.tensor(n_prompt, device=device)  # [B]
    lr = torch.tensor(n_response, device=device)  # [B]
    # each row's prompt then its response, all rows end to end, padded in one write
    ends = [t for pair in zip(prompt_ids, response_ids) for t in pair]
    flat = torch.cat(ends).long() if ends else torch.zeros(0, dtype=torch.long)
    input_ids = _pad_flat(flat, [a + b for a, b in zip(n_prompt, n_response)], 0).to(device)  # [B, L]
    R = int(lr.max()) if len(lr) else 0
    j = torch.arange(R, device=device)  # [R]
    valid = j[None, :] < lr[:, None]  # [B, R]
    # Response token j of row b sits at position lp[b] + j; the logits predicting it at lp[b] + j - 1.
    pos = (lp[:, None] + j[None, :] - 1).clamp(max=input_ids.shape[1] - 1)  # [B, R]
    targets = torch.gather(input_ids, 1, (pos + 1).clamp(max=input_ids.shape[1] - 1))  # [B, R]
    logits = policy(input_ids)  # [B, L, V]
    picked = torch.gather(logits, 1, pos[:, :, None].expand(-1, -1, logits.shape[-1]))  # [B, R, V]
    logp = log_softmax_tempered(picked, temperature)  # [B, R, V]
    out = torch.gather(logp, 2, targets[:, :, None]).squeeze(2)  # [B, R]
    return out.masked_fill(~valid, 0.0), valid
