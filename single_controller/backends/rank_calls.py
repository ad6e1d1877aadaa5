"""Fan-out calls to trainer rank actors, shared by every trainer backend on Ray.

`await rank_call("finish_train_step(3)", [r.finish_train_step.remote(3) for r in ranks])` awaits
every rank in rank order. A rank whose process is gone raises `TrainerRankDied` naming it (the run
stops and resumes from its checkpoint); any other remote error becomes `TrainerFailed` naming the
rank (the train pump asks where the trainer stands, then aborts and retries the step);
`TrainStepStateError` (split API out of order) passes through unchanged.
"""

from __future__ import annotations

import ray

from single_controller.backends.cpu.trainer import TrainStepStateError
from single_controller.protocols import TrainerFailed, TrainerRankDied


async def rank_call(what: str, refs: list) -> list:
    results = []
    for rank, ref in enumerate(refs):
        try:
            results.append(await ref)
        except (TrainStepStateError, TrainerFailed):
            raise
        except ray.exceptions.ActorDiedError as e:
            raise TrainerRankDied(f"trainer rank {rank} died during {what}: {first_line(e)}") from e
        except Exception as e:
            raise TrainerFailed(f"trainer {what} failed on rank {rank}: {first_line(e)}") from e
    return results


def first_line(e: BaseException) -> str:
    """The first line of a (possibly multi-line, Ray-wrapped) error message."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
