"""`rank_call`: what a failed fan-out to the trainer ranks becomes. A surviving rank's collective
fails the moment its peer's process dies (the connection is reset), often before Ray reports the
death: the failure is then the dead rank's (`TrainerRankDied`, which `run.auto_resume` heals), not
the survivor's error (a bug, which fails the run)."""

import asyncio

import pytest
import ray

from single_controller.backends.common import rank_calls
from single_controller.backends.common.rank_calls import rank_call
from single_controller.protocols import TrainerRankDied


async def _fails(e: BaseException, after_s: float = 0.0):
    await asyncio.sleep(after_s)
    raise e


async def _answers(value, after_s: float = 0.0):
    await asyncio.sleep(after_s)
    return value


async def test_a_survivors_collective_error_is_the_dead_peers_death():
    reset = RuntimeError("gloo: Read error: Connection reset by peer")
    refs = [_fails(reset), _fails(ray.exceptions.ActorDiedError(), after_s=0.2)]  # Ray reports the death later
    with pytest.raises(TrainerRankDied, match=r"trainer rank 1 died during finish_train_step\(3\).*Connection reset"):
        await rank_call("finish_train_step(3)", refs)


async def test_an_error_with_every_peer_alive_is_raised_as_it_is(monkeypatch):
    monkeypatch.setattr(rank_calls, "PEER_DEATH_GRACE_S", 0.3)
    bug = TypeError("a bug in the loss")
    with pytest.raises(TypeError, match="a bug in the loss"):
        await rank_call("train_microbatch", [_fails(bug), _answers(1)])
    # a peer still busy past the grace: the error is raised after the grace, as it is
    with pytest.raises(TypeError, match="a bug in the loss"):
        await rank_call("train_microbatch", [_fails(bug), _answers(1, after_s=5.0)])
