"""Batched autoregressive sampling with a KV cache.

`sample(policy, prompt_ids, ...)` draws up to `max_new_tokens` per row from softmax(logits / T),
within the top-p nucleus, and reports each token's logprob under the tempered, un-truncated policy:
what the trainer recomputes, so both agree to rounding and every importance ratio stays finite. A
row stops at one of `stop_token_ids` (later positions masked, `pad_id`, logprob 0); sampling ends
once every row has stopped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from single_controller.algorithm.logprobs import log_softmax_tempered


@dataclass(frozen=True)
class SampleOutput:
    tokens: torch.Tensor  # [B, N] int64, pad_id after a row stopped
    logprobs: torch.Tensor  # [B, N] float, 0 after a row stopped
    mask: torch.Tensor  # [B, N] bool, True on real tokens (incl. the stop token)
    lengths: torch.Tensor  # [B] int64, real tokens per row

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [n_i], logprobs [n_i]) of row i's real tokens."""
        n = int(self.lengths[i])
        return self.tokens[i, :n].clone(), self.logprobs[i, :n].clone()


def row_uniforms(seed: int, rows: Sequence[tuple[str, int]], n: int) -> torch.Tensor:
    """[B, n] float64 in [0, 1): the draws of each row, from (the run's seed, its group id, i.e. its
    prompt and attempt, and its index in the group) alone. A row samples the same tokens from the
    same logits whatever worker or batch it lands in: a run's rollouts do not depend on how many
    workers it has or on which of them a pool gives it."""
    out = torch.empty(len(rows), n, dtype=torch.float64)
    for b, (group_id, j) in enumerate(rows):
        key = hashlib.blake2b(f"{seed}/{group_id}/{j}".encode(), digest_size=8).digest()
        draws = torch.Generator().manual_seed(int.from_bytes(key, "little"))
        out[b] = torch.rand(n, dtype=torch.float64, generator=draws)
    return out


def _draw(
    logp: torch.Tensor, top_p: float, generator: torch.Generator | None, u: torch.Tensor | None = None
) -> torch.Tensor:
    probs = logp.exp()  # [B, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
    if u is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [B]
    # inverse CDF at the row's own draw: the first token whose cumulative mass exceeds u * total
    cdf = probs.double().cumsum(-1)  # [B, V]
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)  # [B]
    return tok.clamp_(max=probs.shape[-1] - 1)


@torch.inference_mode()
def sample(
    policy,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_token_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    share_prompts: bool = True,
    uniforms: torch.Tensor | None = None,
) -> SampleOutput:
    """Sample continuations of `prompt_ids` [B, Tp] (rows share their prompt length).

    `greedy` takes the argmax instead of drawing (for evaluation); logprobs are reported as above.
    `share_prompts` (and a policy with `expand_cache`): each distinct prompt is prefilled once and
    its cache copied to the rows that repeat it (a GRPO group's G rows): the same logits, 1/G of
    the prefill's compute. `uniforms` [B, max_new_tokens] (`row_uniforms`): each row's own draws,
    instead of `generator`'s shared stream.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    B, Tp = prompt_ids.shape
    if Tp + max_new_tokens > policy.max_seq_len:
        raise ValueError(f"prompt {Tp} + {max_new_tokens} new tokens exceeds max_seq_len {policy.max_seq_len}")
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long)
    logprobs = torch.zeros(B, max_new_tokens)
    mask = torch.zeros(B, max_new_tokens, dtype=torch.bool)
    alive = torch.ones(B, dtype=torch.bool)  # [B] rows that have not emitted the stop token
    stops = torch.tensor(stop_token_ids, dtype=torch.long) if stop_token_ids else None
    unique, owner = torch.unique(prompt_ids, dim=0, return_inverse=True) if share_prompts else (prompt_ids, None)
    shares = callable(getattr(policy, "expand_cache", None)) and getattr(policy, "shares_prefixes", True)
    if owner is not None and unique.shape[0] < B and shares:
        cache = policy.new_cache(unique.shape[0], Tp + max_new_tokens)
        logits = policy.forward_cached(unique, cache)[:, -1].index_select(0, owner)  # [B, V]
        cache = policy.expand_cache(cache, owner)
    else:
        cache = policy.new_cache(B, Tp + max_new_tokens)
        logits = policy.forward_cached(prompt_ids, cache)[:, -1]  # [B, V]
    for t in range(max_new_tokens):
        # Exits: max_new_tokens drawn, or every row has stopped.
        logp = log_softmax_tempered(logits, temperature)  # [B, V]
        u = None if uniforms is None else uniforms[:, t]
        tok = logp.argmax(-1) if greedy else _draw(logp, top_p, generator, u)  # [B]
        tokens[:, t] = tok.masked_fill(~alive, pad_id)
        logprobs[:, t] = logp.gather(1, tok[:, None]).squeeze(1).masked_fill(~alive, 0.0).float()
        mask[:, t] = alive
        if stops is not None:
            alive = alive & ~torch.isin(tok, stops)
        if t + 1 == max_new_tokens or not alive.any():
            break
        logits = policy.forward_cached(tok[:, None], cache)[:, -1]  # [B, V]
    return SampleOutput(tokens=tokens, logprobs=logprobs, mask=mask, lengths=mask.sum(1))
