"""Multi-turn episodes (`backends/common/episodes.py`) and the torch worker playing them: exact token
ids in and out, the loss mask on policy tokens only, retries and deadlines of the environment,
failed groups never stored, cancel and weight updates between turns."""

import asyncio
import dataclasses

import pytest
import torch

from replay.storage import GENERATION_FIELDS, InMemoryRowStorage, row_keys
from single_controller.algorithm.logprobs import token_logprobs
from single_controller.backends.common.episodes import Continuation, EpisodeRunner, rows_of
from single_controller.backends.common.weights import pack_weights
from single_controller.backends.torch.generation import GenerationActor
from single_controller.backends.torch.model import TinyGPT
from single_controller.config.schema import EnvConfig, ModelConfig
from single_controller.data.tasks import TOKENIZER
from single_controller.envs.contract import Action, StepOutcome, ToolCall
from single_controller.protocols import ContextFull, EnvironmentFailed, GenerationFailed
from single_controller.types import GenerationRequest, Prompt, SamplingParams, WeightsHandle

torch.set_num_threads(1)
EOS = TOKENIZER.eos_id
ENC = TOKENIZER.encode


class Calls:
    """Shared log of what the scripted environments saw."""

    def __init__(self):
        self.resets, self.actions, self.closed, self.failures = 0, [], 0, 0


class Scripted:
    """Answers `?K` with `=VVV>` (a tool call), anything else ends the episode: reward 1 for `123`."""

    def __init__(self, calls: Calls, fail_steps: int = 0, hang: bool = False):
        self.calls, self.fail_steps, self.hang = calls, fail_steps, hang

    async def reset(self, item):
        self.calls.resets += 1
        return ""

    async def step(self, action: Action) -> StepOutcome:
        self.calls.actions.append(action)
        if self.hang:
            await asyncio.sleep(3600)
        if self.calls.failures < self.fail_steps:
            self.calls.failures += 1
            raise RuntimeError("environment is down")
        if action.tool_call is not None:
            return StepOutcome(observation="=123>")
        return StepOutcome(reward=1.0 if action.text == "123" else 0.0, done=True)

    async def close(self):
        self.calls.closed += 1


class QParser:
    def parse(self, text: str):
        return ToolCall("lookup", text[1:]) if text.startswith("?") else None


class ScriptedEngine:
    """Answers each continuation with the next scripted turn (ids as the engine 'sampled' them)."""

    max_seq_len = 64

    def __init__(self, turns: list[str], version: int = 0, fail: bool = False):
        self.turns, self.version, self.fail, self.seen = turns, version, fail, []

    async def continue_sequence(self, ids, max_new, request, stop_ids):
        self.seen.append(list(ids))
        if self.fail:
            raise GenerationFailed("engine broke")
        k = list(ids).count(EOS)  # turns so far: each ended at the stop token
        text = self.turns[min(k, len(self.turns) - 1)]
        out = ENC(text)[:max_new]
        return Continuation(tuple(out), tuple(-0.5 - 0.01 * i for i in range(len(out))), (self.version,) * len(out))


def req(gid="g0", n=1, prompt_text="^4>", **sampling) -> GenerationRequest:
    prompt = Prompt(f"p-{gid}", tuple(TOKENIZER.encode(prompt_text)), answer="123")
    return GenerationRequest(gid, prompt, SamplingParams(n=n, max_new_tokens=4, **sampling), row_keys(gid, n))


def runner(calls: Calls, cfg: EnvConfig | None = None, **env_kw) -> EpisodeRunner:
    cfg = cfg or EnvConfig(fn="scripted", max_turns=3, timeout_s=0.3, max_attempts=2, retry_backoff_s=0.05)
    return EpisodeRunner(cfg, lambda: Scripted(calls, **env_kw), TOKENIZER, QParser(), default_max_new=4)


async def test_an_episode_keeps_the_sampled_and_inserted_ids_and_masks_only_the_policy_tokens():
    calls = Calls()
    engine = ScriptedEngine(["?4$", "123$"])
    [ep] = await runner(calls).run_group(req(), engine)
    assert ep.prompt_ids == ENC("^4>")
    assert ep.response_ids == ENC("?4$") + ENC("=123>") + ENC("123$")
    assert ep.mask == [True] * 3 + [False] * 5 + [True] * 4
    assert ep.logprobs[3:8] == [0.0] * 5 and ep.logprobs[:3] == pytest.approx([-0.5, -0.51, -0.52])
    assert ep.reward == 1.0 and ep.turns == 2 and ep.tool_calls == 1 and not ep.truncated
    assert [a.text for a in calls.actions] == ["?4", "123"]  # without the stop token
    assert calls.actions[0].tool_call == ToolCall("lookup", "4")
    # the second turn continued the very sequence: prompt, the first turn, the observation
    assert engine.seen[1] == ENC("^4>") + ENC("?4$") + ENC("=123>")
    cols = rows_of([ep])
    assert cols["response_mask"][0].tolist() == ep.mask and cols["response_ids"][0].tolist() == ep.response_ids
    assert calls.closed == 1


async def test_max_turns_ends_an_episode_with_the_truncated_reward_not_an_error():
    calls = Calls()
    cfg = EnvConfig(fn="x", max_turns=2, truncated_reward=-0.5, timeout_s=1.0)
    [ep] = await runner(calls, cfg).run_group(req(), ScriptedEngine(["?4$"]))
    assert ep.truncated and ep.reward == -0.5 and ep.turns == 2
    assert ep.mask == [True] * 3 + [False] * 5 + [True] * 3  # no observation after the last turn


async def test_a_failed_environment_call_restarts_the_episode_with_a_fresh_environment():
    calls = Calls()
    [ep] = await runner(calls, fail_steps=1).run_group(req(), ScriptedEngine(["?4$", "123$"]))
    assert ep.attempts == 2 and ep.reward == 1.0
    assert calls.resets == 2 and calls.closed == 2


async def test_an_environment_failing_every_attempt_fails_the_whole_group_with_env_failed():
    calls = Calls()
    with pytest.raises(EnvironmentFailed, match=r"group g0: episode \d failed 2 time\(s\).*environment is down"):
        await runner(calls, fail_steps=99).run_group(req(n=4), ScriptedEngine(["?4$", "123$"]))
    assert calls.closed == calls.resets  # every environment started was closed


async def test_a_hanging_environment_costs_its_deadline_and_names_the_call():
    calls = Calls()
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(
        EnvironmentFailed, match=r"environment step for episode p-g0#0.*no answer within env.timeout_s=0.3s"
    ):
        await runner(calls, hang=True).run_group(req(), ScriptedEngine(["?4$"]))
    assert asyncio.get_running_loop().time() - t0 < 2.0  # two attempts of 0.3 s, no hang


class LongFirstObservation(Scripted):
    """Opens every episode of prompt `p-full` with an observation of `tokens` tokens."""

    tokens = 40

    async def reset(self, item):
        self.calls.resets += 1
        return "=" + "1" * (self.tokens - 2) + ">" if item.prompt_id == "p-full" else ""


async def test_a_first_observation_that_fills_the_context_fails_the_group_with_context_full():
    """No room for even one policy token (3 prompt + 62 observation tokens of the engine's 64): not a
    ValueError that fails the worker's call, not an environment failure (nothing to retry), but
    `ContextFull` naming the group and the sizes; the environments opened are closed."""
    calls = Calls()
    LongFirstObservation.tokens = 62
    r = EpisodeRunner(
        EnvConfig(fn="x", max_turns=3, timeout_s=1.0),
        lambda: LongFirstObservation(calls),
        TOKENIZER,
        QParser(),
        default_max_new=4,
    )
    engine = ScriptedEngine(["123$"])
    with pytest.raises(
        ContextFull,
        match=r"group full: episode p-full#\d: the prompt \(3 tokens\) and the "
        r"environment's first observation \(62 tokens\) fill the model's 64 positions",
    ) as info:
        await r.run_group(req("full", n=2), engine)
    assert not isinstance(info.value, EnvironmentFailed)
    assert engine.seen == [] and calls.closed == calls.resets >= 1
    # one token of room (3 + 60 of 64) is an episode, not a failure: its one token is its action
    LongFirstObservation.tokens = 60
    [ep] = await r.run_group(req("full"), engine)
    assert ep.policy_tokens == 1 and ep.turns == 1 and ep.last_action == "1" and ep.reward == 0.0


async def test_an_engine_error_is_not_an_environment_failure():
    with pytest.raises(GenerationFailed, match="engine broke") as info:
        await runner(Calls()).run_group(req(n=2), ScriptedEngine(["?4$"], fail=True))
    assert not isinstance(info.value, EnvironmentFailed)


# -- the torch worker ---------------------------------------------------------------------------


def model(seed=0) -> TinyGPT:
    return TinyGPT(ModelConfig(), TOKENIZER.vocab_size, seed=seed)


def handle(version: int, seed: int) -> WeightsHandle:
    snap = pack_weights(model(seed), version)
    return WeightsHandle(version, snap, snap.manifest.num_bytes)


class SlowScripted(Scripted):
    """Every step takes `delay` seconds (so tests can act between turns); tool call = any `?`."""

    delay = 0.0

    async def step(self, action: Action) -> StepOutcome:
        self.calls.actions.append(action)
        await asyncio.sleep(self.delay)
        if len(self.calls.actions) % 3 == 0:
            return StepOutcome(reward=float(action.text.count("1")), done=True)
        return StepOutcome(observation="=123>")


def env_actor(storage, calls: Calls, env_cls=SlowScripted, **env_kw) -> GenerationActor:
    cfg = EnvConfig(fn="tests:scripted", max_turns=3, timeout_s=5.0, **env_kw)
    actor = GenerationActor(
        "gen-env", ModelConfig(), lambda: storage, "single_controller.data.tasks:positional_match_reward", seed=0
    )
    actor._episodes = EpisodeRunner(
        cfg, lambda: env_cls(calls), TOKENIZER, QParser(), default_max_new=3, name="gen-env"
    )
    from single_controller.backends.torch.turn_batches import TurnBatcher

    actor._batcher = TurnBatcher(int(actor._core.policy.max_seq_len), actor._continue_in_turn, actor._pass_gate)
    return actor


async def test_the_worker_stores_multi_turn_rows_whose_logprobs_the_trainer_reproduces():
    storage, calls = InMemoryRowStorage(), Calls()
    actor = env_actor(storage, calls)
    await actor.update_weights(handle(0, seed=0))
    r = req("g1", n=4, temperature=1.0)
    res = await actor.generate(r)
    rows = storage.get_rows_sync(r.row_keys, GENERATION_FIELDS)
    assert res.episode_stats["episodes"] == 4 and res.episode_stats["observation_tokens"] > 0
    for i in range(4):
        mask, ids = rows["response_mask"][i], rows["response_ids"][i]
        assert not mask.all() and mask.any()  # observations inside, masked out
        assert (rows["gen_logprobs"][i][~mask] == 0).all()
        assert (rows["token_versions"][i] == 0).all()
        # the trainer's logprobs of the policy tokens equal the sampled ones (same weights)
        prompt = rows["prompt_ids"][i]
        got, _ = token_logprobs(model(0), [prompt], [ids])
        assert torch.allclose(got[0][mask], rows["gen_logprobs"][i][mask], atol=1e-4)
    assert res.response_lengths == tuple(len(x) for x in rows["response_ids"])
    await actor.close()


async def test_a_group_cancelled_between_turns_writes_no_row():
    storage, calls = InMemoryRowStorage(), Calls()
    SlowScripted.delay = 0.2
    try:
        actor = env_actor(storage, calls)
        await actor.update_weights(handle(0, seed=0))
        r = req("g2", n=2)
        [out] = await asyncio.gather(_cancel_soon(actor, r), return_exceptions=False)
        assert isinstance(out, GenerationFailed) and "cancelled" in str(out)
        await asyncio.sleep(0.5)  # the environment's steps that were under way are over
        assert storage.statistics().puts == 0
        assert await actor.in_flight() == 0
    finally:
        SlowScripted.delay = 0.0
    await actor.close()


async def _cancel_soon(actor: GenerationActor, r: GenerationRequest):
    task = asyncio.create_task(actor.generate_many([r]))
    await asyncio.sleep(0.1)  # in its first environment step
    assert await actor.cancel(r.group_id) is False
    [out] = await task
    return out


async def test_a_weight_update_between_turns_stamps_each_policy_token_with_its_version():
    storage, calls = InMemoryRowStorage(), Calls()
    SlowScripted.delay = 0.3
    try:
        actor = env_actor(storage, calls)
        await actor.update_weights(handle(0, seed=0))
        r = req("g3", n=1)
        task = asyncio.create_task(actor.generate(r))
        await asyncio.sleep(0.15)  # the first turn is sampled, its step under way
        await actor.update_weights(handle(1, seed=1))
        res = await task
    finally:
        SlowScripted.delay = 0.0
    rows = storage.get_rows_sync(r.row_keys, GENERATION_FIELDS)
    versions, mask = rows["token_versions"][0], rows["response_mask"][0]
    assert (res.version_start, res.version_end) == (0, 1)
    first_turn = int(mask.long().argmin())  # the first observation token
    assert (versions[:first_turn] == 0).all() and (versions[mask][first_turn:] == 1).all()
    await actor.close()


async def test_an_environment_failure_answers_the_group_alone_and_stores_nothing():
    storage, calls = InMemoryRowStorage(), Calls()

    class Broken(SlowScripted):
        async def step(self, action):
            raise ValueError("bad env")

    actor = env_actor(storage, calls, env_cls=Broken, max_attempts=2)
    await actor.update_weights(handle(0, seed=0))
    [out] = await actor.generate_many([req("g4", n=2)])
    assert isinstance(out, EnvironmentFailed) and "bad env" in str(out)
    assert storage.statistics().puts == 0
    assert (await actor.statistics()).env_failures == 1
    await actor.close()


async def test_a_group_whose_context_is_full_is_answered_alone_and_its_batch_mates_are_stored():
    """The torch worker: a group whose first observation leaves no room for a policy token is answered
    with `ContextFull` alone; the healthy group of the same call is answered and stored as ever."""
    storage, calls = InMemoryRowStorage(), Calls()

    class FillsTheContext(SlowScripted):
        async def reset(self, item):
            return "=" + "1" * 40 + ">" if item.prompt_id == "p-full" else ""

    actor = env_actor(storage, calls, env_cls=FillsTheContext)  # TinyGPT: 32 positions
    await actor.update_weights(handle(0, seed=0))
    full, healthy = req("full", n=2), req("ok", n=2)
    out_full, out_ok = await actor.generate_many([full, healthy])
    assert isinstance(out_full, ContextFull) and "no room for one policy token" in str(out_full)
    assert out_ok.group_id == "ok" and out_ok.episode_stats["episodes"] == 2
    assert await storage.resident_keys() == set(healthy.row_keys)
    await actor.close()


def test_rows_of_matches_the_storage_schema():
    from replay.storage import ROLLOUT_SCHEMA
    from single_controller.backends.common.episodes import Episode

    e = Episode(prompt_ids=[1, 2])
    e.add([3, 4], [-0.1, -0.2], [5, 5], policy=True)
    e.add([6], [0.0], [5], policy=False)
    for name, col in rows_of([e]).items():
        assert col[0].dtype == ROLLOUT_SCHEMA[name].dtype, name


# -- token in, token out with a BPE chat template ------------------------------------------------


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    from single_controller.data.hf_model import init_model

    return init_model(tmp_path_factory.mktemp("bpe") / "m", tokenizer="bpe", max_positions=128, seed=0)


class ChatEnv:
    """Answers the first turn with the observation `ok`, ends the episode at the second."""

    def __init__(self):
        self.turns = 0

    async def reset(self, item):
        return ""

    async def step(self, action):
        self.turns += 1
        return StepOutcome(observation="ok") if self.turns == 1 else StepOutcome(reward=1.0, done=True)


class IdsEngine:
    """Continues with fixed ids (as if sampled), whatever they decode to."""

    max_seq_len = 128

    def __init__(self, turns: list[list[int]]):
        self.turns, self.calls = turns, 0

    async def continue_sequence(self, ids, max_new, request, stop_ids):
        out = self.turns[self.calls]
        self.calls += 1
        return Continuation(tuple(out), tuple(-1.0 for _ in out), (0,) * len(out))


def _unmerged(tok) -> list[int]:
    """Ids of a multi-byte BPE token's bytes one by one: text whose re-encoding merges them."""
    for piece, _ in sorted(tok.tok.get_vocab().items(), key=lambda kv: kv[1]):
        if len(piece) >= 3 and piece.isalpha() and piece.isascii():
            ids = [tok.encode(c)[0] for c in piece]
            if tok.encode(tok.decode(ids)) != ids:
                return ids
    raise AssertionError("no merged token in the vocabulary")


async def test_stored_ids_are_the_sampled_ids_where_re_tokenizing_the_text_gives_others(bpe_dir):
    from single_controller.algorithm.losses import grpo_loss
    from single_controller.data.tokenizer import load_tokenizer
    from single_controller.types import LossConfig

    tok = load_tokenizer(str(bpe_dir))
    end = tok.eos_ids[0]  # <|im_end|> ends a turn of the ChatML template
    first, second = _unmerged(tok) + [end], _unmerged(tok)[::-1] + [end]
    assert tok.encode(tok.decode(first[:-1])) != first[:-1]  # the trap: decode + encode changes the ids
    prompt_ids = tok.render_chat([{"role": "user", "content": "hi"}])
    r = GenerationRequest(
        "gb", Prompt("pb", tuple(prompt_ids)), SamplingParams(n=1, max_new_tokens=8), row_keys("gb", 1)
    )
    cfg = EnvConfig(fn="x", max_turns=3, timeout_s=1.0)
    [ep] = await EpisodeRunner(cfg, ChatEnv, tok, QParser(), default_max_new=8).run_group(r, IdsEngine([first, second]))

    obs = ep.response_ids[len(first) : len(ep.response_ids) - len(second)]
    assert ep.response_ids == first + obs + second  # exactly what was sampled, around the observation
    assert ep.mask == [True] * len(first) + [False] * len(obs) + [True] * len(second)
    # the observation as inserted: the template's tokens between the turns, the policy's <|im_end|> not repeated
    assert tok.tok.decode(obs) == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    assert ep.prompt_ids == prompt_ids
    # the loss counts exactly the sampled tokens
    cols = rows_of([ep])
    mask = cols["response_mask"][0][None]
    logp = torch.randn(mask.shape, requires_grad=True)
    out = grpo_loss(logp, cols["gen_logprobs"][0][None], torch.ones(1), mask, LossConfig())
    out.loss_sum.backward()
    assert out.num_tokens == len(first) + len(second)
    assert (logp.grad[0][~mask[0]] == 0).all() and (logp.grad[0][mask[0]] != 0).all()


async def test_a_group_for_a_version_waits_for_it_and_version_zero_is_served_at_once():
    storage, calls = InMemoryRowStorage(), Calls()
    actor = env_actor(storage, calls)
    await actor.update_weights(handle(0, seed=0))
    r0 = dataclasses.replace(req("gv0", n=1), min_version=0)
    assert (await asyncio.wait_for(actor.generate(r0), 10)).version_start == 0
    r1 = dataclasses.replace(req("gv1", n=1), min_version=1)
    held = asyncio.create_task(actor.generate(r1))
    await asyncio.sleep(0.3)
    assert not held.done() and storage.statistics().puts == 1  # held for version 1
    await actor.update_weights(handle(1, seed=1))
    assert (await asyncio.wait_for(held, 10)).version_start == 1
    await actor.close()


async def test_an_eval_request_plays_its_episodes_and_stores_nothing():
    storage, calls = InMemoryRowStorage(), Calls()
    actor = env_actor(storage, calls)
    await actor.update_weights(handle(0, seed=0))
    prompt = Prompt("pe", tuple(ENC("^4>")), answer="123")
    r = GenerationRequest("ge", prompt, SamplingParams(n=2, max_new_tokens=3, temperature=0.0), eval=True)
    res = await actor.generate(r)
    assert len(res.rewards) == 2 and res.episode_stats["episodes"] == 2 and res.episode_stats["turns"] >= 2
    assert storage.statistics().puts == 0
    assert (await actor.statistics()).eval_requests == 1
    await actor.close()
