"""Log-probabilities of given tokens under a causal policy: the one formula every trainer backend
(torch, Megatron) and the torch sampler use, so generation and training logprobs agree.

`log_softmax_tempered(logits, temperature)` is the policy's log-distribution at a temperature;
`token_logprobs(policy, prompts, responses, temperature)` the logprobs [B, R] of each response token
with its validity mask (`policy`: any module mapping ids [B, L] to logits [B, L, V]); `pad_right`
stacks 1-D rows into [B, max_len]. Pure torch: no engine, no Ray, no asyncio.

The float32 log-distribution of the response tokens is never whole: `picked_logprobs` computes it a
chunk of tokens at a time (at most `CHUNK_BYTES`), forward and backward (which recomputes each
chunk's), so a 151,936-token vocabulary costs a chunk's worth of float32 beside the logits, not
four [tokens, vocab] float32 tensors. Each chunk's backward is torch's own (its forward recomputed
under autograd): equal values, bit-equal gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn


class SharedPrefixPolicy(Protocol):
    """A policy that runs each distinct prefix once: (logits [U, P, V] of the prefixes, logits
    [B, S, V] of the continuations, row b continuing prefix owner[b])."""

    def forward_shared_prefix(
        self, prefix_ids: torch.Tensor, owner: torch.Tensor, suffix_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...


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
    done per row in torch (a `pad_sequence`, a `cat`) costs microseconds each, so padding row by row
    costs more than the rows' data."""
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


# The float32 log-distribution of at most this many bytes exists at once (a chunk of tokens x vocabulary).
CHUNK_BYTES = 1 << 26


class _PickedLogprobs(torch.autograd.Function):
    """log_softmax(logits[rows] / temperature) at `targets` (and, without gradient, its entropy), for
    the `rows` of a [M, V] view of the logits, a chunk of rows at a time (see the module docstring)."""

    @staticmethod
    def forward(ctx, flat, rows, targets, temperature, chunk, entropy):
        work = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else flat.dtype
        out = torch.empty(rows.shape[0], dtype=work, device=flat.device)
        ent = torch.empty_like(out) if entropy else None
        for s in range(0, rows.shape[0], chunk):
            logp = log_softmax_tempered(flat.index_select(0, rows[s : s + chunk]), temperature)  # [c, V]
            out[s : s + chunk] = logp.gather(1, targets[s : s + chunk, None])[:, 0]
            if ent is not None:
                ent[s : s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(flat, rows, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        if ent is None:
            return out, torch.zeros(0, dtype=work, device=flat.device)
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_ent):
        flat, rows, targets = ctx.saved_tensors
        grad = torch.zeros_like(flat)
        for s in range(0, rows.shape[0], ctx.chunk):
            r, t = rows[s : s + ctx.chunk], targets[s : s + ctx.chunk]
            with torch.enable_grad():  # the chunk's forward again, differentiated by torch's own backward
                x = flat.index_select(0, r).detach().requires_grad_(True)
                picked = log_softmax_tempered(x, ctx.temperature).gather(1, t[:, None])[:, 0]
                (part,) = torch.autograd.grad(picked, x, grad_out[s : s + ctx.chunk])
            grad.index_add_(0, r, part)
        return grad, None, None, None, None, None


def picked_logprobs(
    logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For each of `rows` (indices into logits viewed [M, V]): the log-probability of its target under
    log_softmax(logits / temperature), and (detached, if asked) the distribution's entropy; [N] each,
    in float32 (float64 logits: float64). Chunked: see the module docstring."""
    vocab = logits.shape[-1]
    chunk = max(1, CHUNK_BYTES // (4 * max(vocab, 1)))
    out, ent = _PickedLogprobs.apply(logits.reshape(-1, vocab), rows, targets, temperature, chunk, entropy)
    return out, ent if entropy else None


def shared_prefix_module(policy: LogitsPolicy) -> SharedPrefixPolicy | None:
    """The module behind `policy` (a DDP wrapper's `.module`) if it can run shared prefixes now."""
    module = getattr(policy, "module", policy)
    if callable(getattr(module, "forward_shared_prefix", None)) and getattr(module, "shares_prefixes", False):
        return cast(SharedPrefixPolicy, module)
    return None


def token_logprobs(
    policy: LogitsPolicy,
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    temperature: float = 1.0,
    share_prefixes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs_entropy` without the entropy: (logprobs [B, R], valid [B, R])."""
    logp, valid, _ = token_logprobs_entropy(
        policy, prompt_ids, response_ids, temperature, share_prefixes, entropy=False
    )
    return logp, valid


def token_logprobs_entropy(
    policy: LogitsPolicy,
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    temperature: float = 1.0,
    share_prefixes: bool = False,
    *,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of each response token given its prompt and the response tokens before it.

    Returns (logprobs [B, R], valid [B, R], entropy [B, R] or None) with R the longest response;
    `valid` is False on padding. `entropy`: also the policy's entropy at each response position,
    -sum_v p_v log p_v of the same tempered distribution, detached (a statistic, never trained).
    The distribution is log_softmax(logits / temperature), exactly as `sampling.sample` reports it.
    `policy` may be a DDP wrapper: it is only called, never inspected.

    `share_prefixes` (and a policy with `forward_shared_prefix`, e.g. `TinyGPT`, the HF adapter): rows
    with the same prompt (a GRPO group's) run it once; its keys and values are gathered for each row,
    whose response then attends to them. The same function of the parameters as the one forward of
    whole rows (`tests/unit/test_shared_prefix.py`), for a fraction of the prompt's compute.
    """
    n_prompt = [p.shape[0] for p in prompt_ids]
    if min(n_prompt, default=1) < 1:
        raise ValueError("every row needs at least one prompt token")
    shared = shared_prefix_module(policy) if share_prefixes else None
    if shared is not None and _repeats(prompt_ids):
        return _shared_prefix_logprobs(shared, prompt_ids, response_ids, temperature, entropy)
    device = next(policy.parameters()).device  # rows arrive on the CPU; the policy may be on a GPU
    n_response = [r.shape[0] for r in response_ids]
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
    rows = (torch.arange(len(n_prompt), device=device)[:, None] * input_ids.shape[1] + pos)[valid]  # [N]
    logp, ent = picked_logprobs(logits, rows, targets[valid], temperature, entropy)
    return _scatter_valid(logp, valid), valid, None if ent is None else _scatter_valid(ent, valid)


def _scatter_valid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N] values of the valid positions (row-major) -> [B, R], zero elsewhere (differentiable)."""
    out = torch.zeros(valid.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(valid, values)


def _repeats(prompt_ids: Sequence[torch.Tensor]) -> bool:
    """Whether some prompt occurs twice (else sharing saves nothing and costs a second forward)."""
    seen = {tuple(p.tolist()) for p in prompt_ids}
    return len(seen) < len(prompt_ids)


def _shared_prefix_logprobs(
    policy: SharedPrefixPolicy,
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    temperature: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`token_logprobs_entropy` with each distinct prompt run once, one forward per prompt length."""
    device = next(policy.parameters()).device
    n_response = [r.shape[0] for r in response_ids]
    B, R = len(response_ids), max(n_response, default=0)
    valid = torch.arange(R, device=device)[None, :] < torch.tensor(n_response, device=device)[:, None]  # [B, R]
    by_length: dict[int, list[int]] = {}
    for b, p in enumerate(prompt_ids):
        by_length.setdefault(p.shape[0], []).append(b)
    parts = []
    for rows in by_length.values():
        prompts = torch.stack([prompt_ids[b] for b in rows]).long().to(device)  # [n, P]
        unique, owner = torch.unique(prompts, dim=0, return_inverse=True)  # [U, P], [n]
        S = max(n_response[b] for b in rows)
        if S == 0:
            continue
        responses = pad_right([response_ids[b] for b in rows], 0, torch.long).to(device)  # [n, S]
        # The continuation is the response without its last token: logits at position i predict token i + 1.
        if S > 1:
            prefix_logits, suffix_logits = policy.forward_shared_prefix(unique, owner, responses[:, : S - 1])
        else:
            prefix_logits, suffix_logits = policy(unique), None
        # Response token 0 is predicted by the prompt's last position, token j by the response's j - 1.
        first = prefix_logits[:, -1].index_select(0, owner)[:, None]  # [n, 1, V]
        picked = first if suffix_logits is None else torch.cat([first, suffix_logits], dim=1)  # [n, S, V]
        flat = torch.arange(picked.shape[0] * S, device=device)  # every position: padding is masked later
        lp, ent = picked_logprobs(picked, flat, responses.reshape(-1), temperature, entropy)
        parts.append((rows, lp.view(-1, S), None if ent is None else ent.view(-1, S)))  # [n, S]
    dtype = parts[0][1].dtype if parts else torch.float32
    out = torch.zeros(B, R, device=device, dtype=dtype)
    ents = torch.zeros(B, R, device=device, dtype=dtype) if entropy else None
    for rows, lp, ent in parts:
        where = (torch.tensor(rows, device=device)[:, None], torch.arange(lp.shape[1], device=device))
        out = out.index_put(where, lp)
        if ents is not None and ent is not None:
            ents = ents.index_put(where, ent)
    return out.masked_fill(~valid, 0.0), valid, None if ents is None else ents.masked_fill(~valid, 0.0)
