"""One GRPO step over the real worker interfaces, in order: the spine the pumps run in pieces.

`grpo_step` is the whole step with nothing overlapped: generate a group per prompt, normalise each
group's rewards into advantages, train on the rows in the split API (begin -> microbatch* ->
finish: one optimizer step), then publish the new weights to every generation worker. It runs as
written on any `GenerationWorker` and `TrainerGroup` (tests run it on the sim workers).

The controller runs these same calls, each block in a pump of its own (`pumps/`), all at once:
the rollout pump keeps the workers busy with the next steps' prompts while the train pump trains
this one, and the weight-sync pump publishes the weights in between. What makes that safe is the
replay buffer (`replay/ledger.py`: each group's state and each prompt's one fate) and the staleness
sampler (`samplers/staleness.py`: which groups step k may train). docs/architecture.md walks one
step's data through these lines, pump by pump.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from replay.storage import TRAIN_ROW_FIELDS, RowStorage, row_keys
from single_controller.algorithm.advantages import grpo_advantages
from single_controller.protocols import GenerationWorker, TrainerGroup, generate
from single_controller.types import (
    GenerationRequest,
    GenerationResult,
    LossConfig,
    Prompt,
    SamplingParams,
    StepResult,
    TrainChunk,
)


async def grpo_step(
    step: int,
    prompts: Sequence[Prompt],
    generators: Sequence[GenerationWorker],
    trainer: TrainerGroup,
    storage: RowStorage,
    *,
    sampling: SamplingParams,
    loss: LossConfig,
    groups_per_chunk: int = 1,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> StepResult:
    """Train policy version `step` into `step + 1` on one group of `sampling.n` completions per prompt."""
    # rollout pump: one group per prompt, sampled and scored by a worker, its rows written to storage
    # (a group is named as the replay buffer names it: the prompt and its attempt)
    requests = [
        GenerationRequest(f"{p.prompt_id}-a0", p, sampling, row_keys(f"{p.prompt_id}-a0", sampling.n)) for p in prompts
    ]
    results = await asyncio.gather(*(generate(generators[i % len(generators)], r) for i, r in enumerate(requests)))

    # advantage pump: each group's rewards normalised within the group (GRPO's baseline)
    advantages = [grpo_advantages(r.rewards, normalize_std=normalize_std, eps=eps) for r in results]

    # train pump: one optimizer step over every row; the ranks read their rows from storage
    await trainer.begin_train_step(step, loss)
    for index, start in enumerate(range(0, len(requests), groups_per_chunk)):
        part = slice(start, start + groups_per_chunk)
        await trainer.train_microbatch(_chunk(step, index, requests[part], results[part], advantages[part]))
    result = await trainer.finish_train_step(step)
    await storage.clear_rows([k for r in requests for k in r.row_keys])  # their slots are free again

    # train pump, after the step: the ranks export version step + 1 (asked for behind the finish)
    weights = await trainer.export_weights(step + 1)
    # weight-sync pump: version step + 1 to every generation worker
    await asyncio.gather(*(g.update_weights(weights) for g in generators))
    return result


def _chunk(
    step: int,
    index: int,
    requests: Sequence[GenerationRequest],
    results: Sequence[GenerationResult],
    advantages: Sequence[tuple[float, ...]],
) -> TrainChunk:
    """The metadata of one `train_microbatch`: row keys, their lengths and advantages, never tensors."""
    keys = tuple(k for r in requests for k in r.row_keys)
    lengths = tuple(res.prompt_length + n for res in results for n in res.response_lengths)
    return TrainChunk(step, index, keys, lengths, TRAIN_ROW_FIELDS, tuple(a for adv in advantages for a in adv))
