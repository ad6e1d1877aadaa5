"""Multi-turn training rows (issue 36) for the trainer tests, in the row schema of replay/storage.py. Not a
test module (no test_ prefix).

A row's `prompt_ids` is the episode's first prompt and its `response_ids` everything after it: blocks of
policy tokens (response_mask True, a generation logprob, token_versions the version that sampled them)
alternating with observation blocks the environment inserted (response_mask False, gen_logprobs 0.0,
token_versions -1 or the version of the policy tokens around them: both occur). The first block is a
policy block, the last one either kind; every block has 1..3 tokens and a row 2..4 policy blocks, so a
row is at most 5 + 8 x 3 = 29 tokens (under TinyGPT's 32 positions). Rows come in groups sharing their
prompt (a GRPO group's episodes), the groups' rows interleaved."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# (prompts, responses) -> logprobs [B, R] of each response token (for gen_logprobs near a real policy's)
LogprobsOf = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], torch.Tensor]


def _episode(g: torch.Generator, vocab: int, version: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One response: (token ids, mask, token versions) of 2..4 policy blocks with observations between
    them and, on a coin flip, one after the last."""

    def draw(lo: int, hi: int) -> int:  # an integer in [lo, hi]
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    n_policy = draw(2, 4)
    obs_version = -1 if draw(0, 1) else version
    blocks: list[tuple[int, bool]] = []  # (length, policy?)
    for i in range(n_policy):
        blocks.append((draw(1, 3), True))
        if i < n_policy - 1 or draw(0, 1):
            blocks.append((draw(1, 3), False))
    mask = torch.cat([torch.full((n,), policy) for n, policy in blocks])
    versions = torch.where(mask, torch.tensor(version), torch.tensor(obs_version))
    return torch.randint(0, vocab, (len(mask),), generator=g), mask, versions


def multi_turn_rows(
    groups: int,
    group_size: int,
    seed: int,
    vocab: int,
    *,
    logprobs_of: LogprobsOf | None = None,
    version: int = 0,
) -> dict:
    """`groups` x `group_size` multi-turn rows (TRAIN_FIELDS), policy tokens sampled at `version`.
    gen_logprobs on policy tokens: `logprobs_of`'s plus noise (importance weights vary, some are
    truncated), or random around log(1/19) without it; 0.0 on observation tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks, versions = [], [], [], []
    for _ in range(groups):
        prompt = torch.randint(0, vocab, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g)
        for _ in range(group_size):
            ids, mask, ver = _episode(g, vocab, version)
            prompts.append(prompt.clone())
            responses.append(ids)
            masks.append(mask)
            versions.append(ver)
    if logprobs_of is not None:
        with torch.no_grad():
            lp = logprobs_of(prompts, responses)
        gens = [lp[i, : len(r)].float() + 0.3 * torch.randn(len(r), generator=g) for i, r in enumerate(responses)]
    else:
        gens = [-torch.rand(len(r), generator=g) * 4 - 1.5 for r in responses]
    order = torch.randperm(len(prompts), generator=g).tolist()  # groups interleaved, as a chunk may hold them
    return {
        "prompt_ids": [prompts[i] for i in order],
        "response_ids": [responses[i] for i in order],
        "gen_logprobs": [torch.where(masks[i], gens[i], 0.0) for i in order],
        "response_mask": [masks[i] for i in order],
        "token_versions": [versions[i] for i in order],
        "advantage": torch.randn(len(order), generator=g),
    }


def policy_blocks(mask: torch.Tensor) -> int:
    """How many runs of True `mask` has."""
    m = mask.to(torch.int8)
    return int(m[0]) + int((m[1:] > m[:-1]).sum())
