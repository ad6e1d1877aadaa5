"""The environment side of multi-turn rollouts: the built-in environments and their tasks, the in-process
loader and its checks, tool-call parsing (no torch, no Ray). Failure modes over HTTP: test_env_http.py."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sys
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from single_controller.config.schema import EnvConfig
from single_controller.data.tasks import EVAL_DATASETS, TASKS, TOKENIZER, is_held_out, load_task
from single_controller.envs.builtin import GuessEnv, LookupEnv, digit_match, other_value
from single_controller.envs.contract import (
    Action,
    EnvContractError,
    Environment,
    EpisodeItem,
    StepOutcome,
    ToolCall,
)
from single_controller.envs.http_client import HttpEnvironment
from single_controller.envs.http_server import EnvServer
from single_controller.envs.inprocess import check_env, check_env_class, load_env_factory
from single_controller.envs.tool_calls import (
    ToolCallFormatError,
    ToolCallParser,
    check_expressible,
)

REGEX = ToolCallParser.from_config(EnvConfig(tool_call="regex"))


# -- a runner as the contract describes it (the real one is the generation side's) ---------------------
@dataclass
class Episode:
    reward: float | None
    turns: int
    transcript: str  # prompt, turns and observations, as the sequence would read (turns end with `$`)
    done: bool


async def run_episode(env: Environment, item: EpisodeItem, policy: Callable[[str], str], max_turns: int) -> Episode:
    transcript = item.prompt + await env.reset(item)
    last_reward, turns = None, 0
    try:
        while turns < max_turns:
            text = policy(transcript)
            turns += 1
            out = await env.step(Action(text, REGEX.parse(text)))
            transcript += text + "$"
            if out.done:
                return Episode(out.reward, turns, transcript, True)
            last_reward = out.reward
            transcript += out.observation
        return Episode(last_reward, turns, transcript, False)
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            await close()


def item_of(task: str, i: int, seed: int = 0) -> EpisodeItem:
    p = TASKS[task](i + 1, 3, seed)[i]
    return EpisodeItem(p.prompt_id, TOKENIZER.decode(p.token_ids), p.answer)


@pytest.fixture(params=["inprocess", "http"])
async def transport(request) -> AsyncIterator[Callable[[str, dict], Awaitable[Callable[[], Environment]]]]:
    """`await make(fn, args)` -> a per-episode factory, in-process or through a real local EnvServer."""
    servers: list[EnvServer] = []

    async def make(fn: str, args: dict) -> Callable[[], Environment]:
        factory = load_env_factory(EnvConfig(fn=fn, args=args))
        if request.param == "inprocess":
            return factory
        server = EnvServer(lambda **request_args: factory(**request_args))
        servers.append(server)
        url = await server.start()
        return lambda: HttpEnvironment(url, timeout_s=5.0)

    yield make
    for server in servers:
        await server.stop()


# -- lookup ------------------------------------------------------------------------------------------
def _key(transcript: str) -> str:
    return transcript[1 : transcript.index(">")]


def lookup_perfect(transcript: str) -> str:
    values = re.findall(r"=([0-9]+)>", transcript)
    return values[-1] if values else f"?{_key(transcript)}"


def lookup_wrong_key(transcript: str) -> str:
    values = re.findall(r"=([0-9]+)>", transcript)
    return values[-1] if values else f"?{(int(_key(transcript)) + 1) % 10}"


def lookup_miscopy(transcript: str) -> str:
    value = lookup_perfect(transcript)
    return value if value.startswith("?") else str((int(value[0]) + 1) % 10) + value[1:]


async def test_lookup_pays_1_only_for_the_right_call_and_the_exact_value(transport):
    factory = await transport("lookup", {})
    for i in range(12):
        item = item_of("lookup", i)
        answer = item.answer
        perfect = await run_episode(factory(), item, lookup_perfect, 4)
        assert perfect.reward == 1.0 and perfect.turns == 2
        assert perfect.transcript == f"{item.prompt}?{_key(item.prompt)}$={answer}>{answer}$"
        # Without the tool: 0.7 of the digits guessed right, nothing for the call.
        blind = await run_episode(factory(), item, lambda t: "000", 4)
        assert blind.reward == pytest.approx(0.7 * sum(a == "0" for a in answer) / 3) and blind.turns == 1
        # Another key's value is a different, fixed value: copying it scores its chance matches only.
        wrong = await run_episode(factory(), item, lookup_wrong_key, 4)
        other = other_value(item.prompt_id, str((int(_key(item.prompt)) + 1) % 10), answer)
        assert other != answer and wrong.transcript.endswith(f"={other}>{other}$")
        assert wrong.reward == pytest.approx(0.1 + 0.7 * digit_match(answer, other)) and wrong.reward < 0.8
        # The right call but one digit wrong: 0.1 + 0.2 + 0.7 * 2/3.
        miscopy = await run_episode(factory(), item, lookup_miscopy, 4)
        assert miscopy.reward == pytest.approx(0.3 + 0.7 * 2 / 3)


async def test_lookup_by_hand(transport):
    factory = await transport("lookup", {})
    item = EpisodeItem("p7", "^3>", "482")
    env = factory()
    assert await env.reset(item) == ""
    empty = await env.step(Action("?", REGEX.parse("?")))
    assert (empty.observation, empty.done, empty.reward) == (":>", False, None)
    other = await env.step(Action("?31", REGEX.parse("?31")))
    assert other.observation == f"={other_value('p7', '31', '482')}>" and other.observation != "=482>"
    right = await env.step(Action("?3", REGEX.parse("?3")))
    assert right.observation == "=482>"
    final = await env.step(Action("4829", REGEX.parse("4829")))
    # 3 of 4 positions (the extra digit counts wrong), and the right call: 0.7 * 3/4 + 0.2 + 0.1
    assert final.done and final.reward == pytest.approx(0.825) and final.info["called_right_key"] is True
    # `?x` does not parse as a call (the default pattern wants digits): a final answer scoring 0.
    env2 = factory()
    await env2.reset(item)
    plain = await env2.step(Action("?x", REGEX.parse("?x")))
    assert plain.done and plain.reward == 0.0
    # A tool call with a hermes-style dict argument and an unknown tool.
    env3 = LookupEnv()
    await env3.reset(item)
    assert (await env3.step(Action("", ToolCall("lookup", {"key": "3"})))).observation == "=482>"
    assert (await env3.step(Action("", ToolCall("calculator", "3")))).observation == ":>"
    assert (await env3.step(Action("", ToolCall("", "x", error="bad JSON")))).observation == ":>"


def test_lookup_values_of_other_keys_are_fixed_per_prompt_and_never_the_answer():
    assert other_value("p1", "5", "482") == other_value("p1", "5", "482")
    assert len({other_value(f"p{i}", "5", "482") for i in range(50)}) > 30
    assert all(other_value(f"p{i}", str(k), "7") != "7" for i in range(50) for k in range(10))
    assert digit_match("482", "482") == 1.0 and digit_match("482", "48") == pytest.approx(2 / 3)
    assert digit_match("482", "4829") == 0.75 and digit_match("482", "") == 0.0


# -- guess -------------------------------------------------------------------------------------------
def binary_search(transcript: str) -> str:
    lo, hi = 0, 9
    for guess, hint in re.findall(r"([0-9])\$([+-])", transcript):
        lo, hi = (int(guess) + 1, hi) if hint == "+" else (lo, int(guess) - 1)
    return str((lo + hi) // 2)


async def test_guess_binary_search_wins_every_secret_in_4_turns_and_a_fixed_guess_does_not(transport):
    factory = await transport("guess", {})
    for secret in "0123456789":
        item = EpisodeItem(f"p{secret}", "^>", secret)
        won = await run_episode(factory(), item, binary_search, 4)
        assert won.done and won.reward == 1.0 and won.turns <= 4, won
        assert won.transcript.endswith(f"{secret}$")
        stuck = await run_episode(factory(), item, lambda t: "0", 4)
        if secret == "0":
            assert stuck.reward == 1.0 and stuck.turns == 1
        else:  # truncated: no reward from the environment (the runner gives env.truncated_reward)
            assert not stuck.done and stuck.reward is None and stuck.turns == 4
            assert stuck.transcript == "^>" + "0$+" * 4


async def test_guess_by_hand_and_shaped(transport):
    env = (await transport("guess", {}))()
    await env.reset(EpisodeItem("p0", "^>", "6"))
    steps = [await env.step(Action(t)) for t in ["12", "", "3", "9", "6"]]
    assert [s.observation for s in steps[:4]] == [":", ":", "+", "-"]
    assert [s.done for s in steps] == [False] * 4 + [True] and steps[-1].reward == 1.0
    shaped = (await transport("guess", {"shaped": True}))()
    await shaped.reset(EpisodeItem("p0", "^>", "6"))
    out = [await shaped.step(Action(t)) for t in ["x", "3", "9", "5"]]
    # 0.5 * (1 - |guess - 6| / 9): 3 -> 1/3, 9 -> 1/3, 5 -> 4/9; not a digit -> 0
    assert [o.reward for o in out] == pytest.approx([0.0, 1 / 3, 1 / 3, 4 / 9])
    truncated = await run_episode(GuessEnv(shaped=True), EpisodeItem("p0", "^>", "6"), lambda t: "5", 4)
    assert not truncated.done and truncated.reward == pytest.approx(4 / 9) and truncated.reward < 1.0


async def test_environments_refuse_an_item_they_cannot_play():
    with pytest.raises(ValueError, match="p3.*not `\\^KEY>`"):
        await LookupEnv().reset(EpisodeItem("p3", "hello", "482"))
    with pytest.raises(ValueError, match="p3 has answer '12', expected 1 digit"):
        await GuessEnv().reset(EpisodeItem("p3", "^>", "12"))
    assert await LookupEnv().reset(EpisodeItem("p3", [{"role": "user"}], "482", columns={"key": "5"})) == ""
    with pytest.raises(TypeError, match="shaped must be true or false"):
        GuessEnv(shaped="yes")  # type: ignore[arg-type]


# -- the tasks -----------------------------------------------------------------------------------------
def test_lookup_and_guess_prompts_are_registered_seeded_and_split_on_the_secret():
    assert load_task("lookup") is TASKS["lookup"] and load_task("guess") is TASKS["guess"]
    train = TASKS["lookup"](300, 3, 0)
    assert train == TASKS["lookup"](300, 3, 0) and train != TASKS["lookup"](300, 3, 1)
    assert [p.prompt_id for p in train[:3]] == ["p00000", "p00001", "p00002"]
    for p in train:
        assert re.fullmatch(r"\^[0-9]>", TOKENIZER.decode(p.token_ids)) and re.fullmatch(r"[0-9]{3}", p.answer)
    assert len({TOKENIZER.decode(p.token_ids) for p in train}) == 10 and not any(is_held_out(p.answer) for p in train)
    held = EVAL_DATASETS["lookup.held_out"](1000, 3, 0)
    assert len(held) == 87 == len({p.answer for p in held}) and all(is_held_out(p.answer) for p in held)
    assert held[0].prompt_id == "h00000" and TASKS["lookup"](5, 5, 0)[0].answer.isdigit()
    assert len(TASKS["lookup"](5, 5, 0)[0].answer) == 5  # task.num_digits is the value's length
    guesses = TASKS["guess"](200, 3, 0)
    assert {TOKENIZER.decode(p.token_ids) for p in guesses} == {"^>"} and {p.answer for p in guesses} == set(
        "0123456789"
    )
    assert guesses == TASKS["guess"](200, 3, 0) and guesses != TASKS["guess"](200, 3, 1)
    eval_guess = EVAL_DATASETS["guess.held_out"](64, 3, 0)
    assert (
        sorted(p.answer for p in eval_guess) == list("0123456789")
        and len(EVAL_DATASETS["guess.held_out"](4, 3, 0)) == 4
    )


def test_prompt_observations_and_default_tool_call_are_in_the_character_vocabulary():
    for text in ["^3>", "^>", "?3$=482>482$", ":>", "+", "-", ":"]:
        assert TOKENIZER.decode(TOKENIZER.encode(text)) == text


# -- loading and checking env.fn -----------------------------------------------------------------------
class _Good:
    def __init__(self, level: int = 0):
        self.level = level

    async def reset(self, item):
        return ""

    async def step(self, action):
        raise NotImplementedError


class _SyncStep:
    async def reset(self, item):
        return ""

    def step(self, action):
        return None


class _NoReset:
    async def step(self, action):
        return None


class _SyncClose(_Good):
    def close(self):
        pass


@pytest.fixture
def env_module(monkeypatch):
    mod = types.SimpleNamespace(Good=_Good, SyncStep=_SyncStep, NoReset=_NoReset, SyncClose=_SyncClose, f=lambda: 0)
    monkeypatch.setitem(sys.modules, "_sc_env_mod", mod)
    return "_sc_env_mod"


def test_env_fn_loads_builtins_and_classes_one_instance_per_episode(env_module):
    factory = load_env_factory(EnvConfig(fn=f"{env_module}:Good", args={"level": 3}))
    a, b = factory(), factory()
    assert isinstance(a, _Good) and a is not b and a.level == 3
    assert isinstance(load_env_factory(EnvConfig(fn="lookup"))(), LookupEnv)
    assert load_env_factory(EnvConfig(fn="guess", args={"shaped": True}))().shaped is True
    check_env(EnvConfig())  # env off: nothing to check


@pytest.mark.parametrize(
    "fn, args, words",
    [
        ("no_such_env_module_xyz:Env", {}, ["'no_such_env_module_xyz:Env'", "cannot import", "No module named"]),
        ("{m}:Missing", {}, ["has no attribute 'Missing'"]),
        ("{m}:f", {}, ["'_sc_env_mod:f'", "is a function, not a class"]),
        ("{m}:SyncStep", {}, ["'_sc_env_mod:SyncStep'", "_SyncStep.step must be `async def`"]),
        ("{m}:NoReset", {}, ["has no reset() method"]),
        ("{m}:SyncClose", {}, ["_SyncClose.close must be `async def`"]),
        ("{m}:Good", {"levle": 1}, ["rejects env.args {'levle': 1}", "levle"]),
        ("lookup", {"x": 1}, ["'lookup'", "rejects env.args"]),
        ("lookups", {}, ["expected a built-in environment (guess, lookup) or 'module:Class'"]),
    ],
)
def test_check_env_names_the_spec_and_what_is_wrong(env_module, fn, args, words):
    with pytest.raises(EnvContractError) as info:
        check_env(EnvConfig(fn=fn.format(m=env_module), args=args))
    for w in words:
        assert w in str(info.value)


def test_check_env_class_on_objects():
    check_env_class(_Good, args={"level": 1})
    with pytest.raises(EnvContractError, match="environment <function"):
        check_env_class(lambda: None)
    with pytest.raises(EnvContractError, match="exclude each other"):
        check_env(EnvConfig(fn="lookup", url="http://127.0.0.1:1"))


# -- tool calls -----------------------------------------------------------------------------------------
def test_regex_tool_calls():
    assert REGEX.format == "regex"
    assert REGEX.parse("?3") == ToolCall("lookup", "3")
    assert REGEX.parse("?") == ToolCall("lookup", "")
    assert REGEX.parse("3") is None and REGEX.parse("?3?") is None and REGEX.parse("x?3") is None
    named = ToolCallParser.from_config(
        EnvConfig(tool_call="regex", tool_call_pattern=r"(?P<name>[a-z]+)\((?P<arguments>.*)\)")
    )
    assert named.parse("add(1,2)") == ToolCall("add", "1,2") and named.parse("add(1,2) ") is None
    assert ToolCallParser.from_config(EnvConfig(tool_call="none")).parse("?3") is None
    with pytest.raises(ToolCallFormatError, match="no named group `arguments`"):
        ToolCallParser.from_config(EnvConfig(tool_call="regex", tool_call_pattern=r"\?([0-9]*)"))
    with pytest.raises(ToolCallFormatError, match="is not a regex"):
        ToolCallParser.from_config(EnvConfig(tool_call="regex", tool_call_pattern=r"(?P<arguments>"))


def test_hermes_tool_calls_and_malformed_ones():
    p = ToolCallParser.from_config(EnvConfig(tool_call="hermes"))
    good = 'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "3"}}\n</tool_call>'
    assert p.parse(good) == ToolCall("lookup", {"key": "3"})
    assert p.parse("the answer is 482") is None
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert p.parse(two) == ToolCall("a", {})  # the first call only
    bad_json = p.parse('<tool_call>{"name": "lookup", "arguments": {key: 3}}</tool_call>')
    assert bad_json is not None and bad_json.error is not None and "not JSON" in bad_json.error
    assert bad_json.arguments == '{"name": "lookup", "arguments": {key: 3}}'
    no_name = p.parse('<tool_call>["lookup"]</tool_call>')
    assert no_name is not None and no_name.error is not None and "name" in no_name.error
    unclosed = p.parse('<tool_call>{"name": "lookup"')
    assert unclosed is not None and unclosed.error == "<tool_call> without </tool_call>"


class _TemplateTokenizer:
    """A tokenizer with a chat template (duck-typed as HFTokenizer: `.tok.chat_template`)."""

    has_chat_template = True

    def __init__(self, template, drop: str = ""):
        self.tok = types.SimpleNamespace(chat_template=template)
        self.drop = drop

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode().replace(self.drop, "") if self.drop else bytes(ids).decode()


def test_auto_is_hermes_when_the_chat_template_mentions_tool_call_else_regex():
    auto = EnvConfig(tool_call="auto")
    assert ToolCallParser.from_config(auto, TOKENIZER).format == "regex"
    assert ToolCallParser.from_config(auto, _TemplateTokenizer("{{ messages }}")).format == "regex"
    assert ToolCallParser.from_config(auto, _TemplateTokenizer("... <tool_call>\n{{ tool }} ...")).format == "hermes"
    by_name = _TemplateTokenizer({"default": "{{ m }}", "tool_use": "<tool_call>"})
    assert ToolCallParser.from_config(auto, by_name).format == "hermes"


def test_a_format_the_tokenizer_cannot_write_is_refused_naming_the_format_and_the_piece():
    hermes = ToolCallParser.from_config(EnvConfig(tool_call="hermes"))
    with pytest.raises(
        ToolCallFormatError, match=r"env.tool_call=hermes.*cannot express '<tool_call>'.*not in the vocab"
    ):
        check_expressible(hermes, TOKENIZER)
    check_expressible(ToolCallParser.from_config(EnvConfig()), TOKENIZER)  # the default pattern: `?`
    call = ToolCallParser.from_config(EnvConfig(tool_call="regex", tool_call_pattern=r"\?(?P<arguments>[0-9]*)(CALL)?"))
    check_expressible(call, TOKENIZER)  # an optional literal is not needed
    call = ToolCallParser.from_config(EnvConfig(tool_call="regex", tool_call_pattern=r"CALL\((?P<arguments>[0-9]*)\)"))
    with pytest.raises(ToolCallFormatError, match=r"env.tool_call=regex.*cannot express 'CALL\('"):
        check_expressible(call, TOKENIZER)
    check_expressible(hermes, _TemplateTokenizer("<tool_call>"))  # bytes write anything
    with pytest.raises(ToolCallFormatError, match=r"'</tool_call>'.*decodes back as ''"):
        check_expressible(hermes, _TemplateTokenizer("<tool_call>", drop="</tool_call>"))  # a skipped special token


# -- in-process environments under the runner's rules, as HTTP ones -----------------------------------------------
class _Wedged(_Good):
    async def step(self, action):
        await asyncio.Event().wait()


class _Raising(_Good):
    async def step(self, action):
        raise KeyError("no such board")

    async def close(self):
        raise OSError("disk gone")


class _NotAnOutcome(_Good):
    async def step(self, action):
        return {"reward": 1.0}


class _ClosingBadly(_Good):
    async def step(self, action):
        return StepOutcome(reward=0.5, done=True)

    async def close(self):
        raise OSError("disk gone")


class _OneTurn:
    """A `TurnEngine` whose every turn is `1$`."""

    max_seq_len = 32

    async def continue_sequence(self, ids, max_new, request, stop_ids):
        from single_controller.backends.common.episodes import Continuation

        out = tuple(TOKENIZER.encode("1$"))
        return Continuation(out, (-1.0,) * len(out), (0,) * len(out))


async def _play(cfg: EnvConfig):
    """One episode of `cfg`'s environment through the runner every engine uses (one attempt)."""
    from single_controller.backends.common.episodes import episode_runner
    from single_controller.types import GenerationRequest, Prompt, SamplingParams

    request = GenerationRequest(
        "g9", Prompt("p00009", tuple(TOKENIZER.encode("^3>")), "482"), SamplingParams(n=1), ("g9_g0",)
    )
    runner = episode_runner(dataclasses.replace(cfg, max_attempts=1), TOKENIZER, default_max_new=2, name="gen")
    return await asyncio.wait_for(runner.run_group(request, _OneTurn()), 10.0)


async def test_in_process_environments_get_deadlines_and_env_failures_like_http_ones(monkeypatch):
    from single_controller.backends.common.episodes import env_factory
    from single_controller.protocols import EnvironmentFailed

    mod = types.SimpleNamespace(Wedged=_Wedged, Raising=_Raising, NotAnOutcome=_NotAnOutcome, Closing=_ClosingBadly)
    monkeypatch.setitem(sys.modules, "_sc_env_bad", mod)
    with pytest.raises(
        EnvironmentFailed, match=r"environment step for episode p00009#0 failed: no answer within env.timeout_s=0.2s"
    ):
        await _play(EnvConfig(fn="_sc_env_bad:Wedged", timeout_s=0.2))
    with pytest.raises(EnvironmentFailed, match=r"step for episode p00009#0 failed: KeyError\('no such board'\)"):
        await _play(EnvConfig(fn="_sc_env_bad:Raising"))
    with pytest.raises(EnvironmentFailed, match="step for episode p00009#0 failed: returned dict, not a StepOutcome"):
        await _play(EnvConfig(fn="_sc_env_bad:NotAnOutcome"))
    # a close that raises leaves the episode's outcome as it was (the environment's leak, not the policy's)
    [episode] = await _play(EnvConfig(fn="_sc_env_bad:Closing"))
    assert episode.reward == 0.5
    good = env_factory(EnvConfig(fn="lookup"))()
    assert isinstance(good, LookupEnv)
    http = env_factory(EnvConfig(url="http://127.0.0.1:8765", timeout_s=3.0, args={"a": 1}))()
    assert isinstance(http, HttpEnvironment) and (http.url, http.timeout_s, http.args) == (
        "http://127.0.0.1:8765",
        3.0,
        {"a": 1},
    )
