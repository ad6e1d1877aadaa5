"""Batched, composable rewards: `reward.functions` called once per group in the generation worker's
reward pool, weighted into the reward, per-function metrics and a sample completion in the step
records, the built-in verifiers, and the config checks that refuse a bad function before a run.

The math_verify table (`tests/data/math_verify_cases.jsonl`) holds cases checked by hand; five cases
on which math-verify 0.9 disagrees with mathematics were left out: `1/3` vs `0.3333333` and
`\\sqrt{2}` vs `1.41421356` (it compares floats rounded to 6 digits: both score 1.0), `50%` vs `50`
(it accepts a percentage's number as well as its value: 1.0), `25%` vs `\\boxed{25\\%}` (the boxed
`\\%` does not parse: 0.0) and `100` vs `1e2` (it reads `1e2` as 1: 0.0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from replay.storage import InMemoryRowStorage, row_keys
from single_controller.backends.common.scoring import GroupToScore, RewardScorer
from single_controller.backends.sim import Faults, sim_rewards
from single_controller.backends.torch.generation import GenerationCore
from single_controller.backends.torch.model import TinyGPT
from single_controller.config.schema import Config, ModelConfig, RewardConfig, RewardFunctionConfig, RunConfig
from single_controller.data import verifiers
from single_controller.data.rewards import reward_form
from single_controller.data.tasks import TOKENIZER, positional_match_reward, reverse_digits
from single_controller.data.verifiers import extract_answer, math_verify, reasoning_gym
from single_controller.preflight.loader import ConfigError, load_config
from single_controller.protocols import RewardFailed
from single_controller.runtime.run_dir import RunDirectory
from single_controller.types import GenerationRequest, GenerationResult, Prompt, SamplingParams
from tests.helpers.sim import assert_clean_end, make_cfg, run_sim

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = reverse_digits(8, 3, seed=0)
HERE = "tests.unit.test_rewards"


def request(i: int, n: int = 4, prompt=None) -> GenerationRequest:
    gid = f"grp{i}"
    return GenerationRequest(gid, prompt or PROMPTS[i], SamplingParams(n=n), row_keys(gid, n))


def core(*functions: RewardFunctionConfig, timeout_s: float = 10.0, max_workers: int = 4, storage=None):
    reward = RewardConfig(functions=tuple(functions), timeout_s=timeout_s, max_workers=max_workers)
    model = TinyGPT(ModelConfig(), TOKENIZER.vocab_size, seed=0)
    storage = storage if storage is not None else InMemoryRowStorage()
    return GenerationCore(model, storage, positional_match_reward, reward=reward, seed=0, version=0, name="gen-3")


def fn(function: str, **kw) -> RewardFunctionConfig:
    return RewardFunctionConfig(fn=f"{HERE}:{function}", **kw)


# ---------------------------------------------------------------- reward functions the tests name

CALLS: list[dict] = []


def recording(prompts, completions, **columns):
    """Records its arguments; 1.0 for a completion that starts with the answer's first digit."""
    CALLS.append({"prompts": prompts, "completions": completions, **columns})
    return [float(c[:1] == a[:1]) for c, a in zip(completions, columns["answer"])]


def length(completions, **_):
    return [float(len(c)) for c in completions]


def only_first_two(completions, **_):
    """Applies to the first two completions only."""
    return [1.0 if i < 2 else None for i in range(len(completions))]


def never(completions, **_):
    return [None] * len(completions)


async def async_match(prompts, completions, answer, **_):
    await asyncio.sleep(0)
    return [float(c == a) for c, a in zip(completions, answer)]


RELEASE = threading.Event()


def stuck_on_grp1(completions, prompt_id, **_):
    """Never returns (until the test releases it) for PROMPTS[1]; 0.5 elsewhere."""
    if prompt_id[0] == PROMPTS[1].prompt_id:
        RELEASE.wait(30)
    return [0.5] * len(completions)


def picky(completions, prompt_id, **_):
    """Raises on PROMPTS[1], gives too few values on PROMPTS[2], a NaN on PROMPTS[3]'s third."""
    if prompt_id[0] == PROMPTS[1].prompt_id:
        raise ValueError("cannot parse the answer")
    if prompt_id[0] == PROMPTS[2].prompt_id:
        return [1.0]
    return [float("nan") if i == 2 and prompt_id[0] == PROMPTS[3].prompt_id else 1.0 for i in range(len(completions))]


SEEN: Counter[str] = Counter()


def legacy_raising_on_third(prompt, text):
    """The per-completion form: raises on its third call for PROMPTS[1] (completion 2)."""
    SEEN[prompt.prompt_id] += 1
    if prompt.prompt_id == PROMPTS[1].prompt_id and SEEN[prompt.prompt_id] == 3:
        raise ZeroDivisionError("boom")
    return positional_match_reward(prompt, text)


def three_positional(prompt, text, scale):
    return 1.0


def no_kwargs(prompts, completions, answer, extra):
    return [1.0] * len(completions)


# ---------------------------------------------------------------- the batched call


def test_a_batched_function_is_called_once_per_group_with_trl_arguments():
    CALLS.clear()
    chat = [{"role": "user", "content": "reverse 123"}]
    with_columns = dataclasses.replace(PROMPTS[1], raw_prompt=chat, columns={"level": 3, "source": "digits"})
    storage = InMemoryRowStorage()
    gen = core(fn("recording"), storage=storage)
    results = gen.generate([request(0), request(1, n=3, prompt=with_columns)])
    assert len(CALLS) == 2  # one call per group, not per completion
    first, second = CALLS
    assert first["prompts"] == [TOKENIZER.decode(PROMPTS[0].token_ids)] * 4  # no raw prompt: the decoded text
    assert second["prompts"] == [chat] * 3  # the dataset's own prompt, here chat messages
    assert second["level"] == [3] * 3 and second["source"] == ["digits"] * 3
    assert second["answer"] == [PROMPTS[1].answer] * 3 and second["prompt_id"] == [PROMPTS[1].prompt_id] * 3
    for call, req in zip(CALLS, (request(0), request(1, n=3))):
        rows = storage.get_rows_sync(req.row_keys, ["response_ids", "reward"])
        assert call["completion_ids"] == [ids.tolist() for ids in rows["response_ids"]]
        assert call["completions"] == [TOKENIZER.decode(ids) for ids in call["completion_ids"]]
        expected = [float(c[:1] == a[:1]) for c, a in zip(call["completions"], call["answer"])]
        assert rows["reward"].tolist() == expected
    assert [r.reward_parts for r in results] == [{"recording": r.rewards} for r in results]


def test_the_reward_is_the_weighted_sum_and_none_contributes_nothing():
    gen = core(fn("length", weight=2.0), fn("only_first_two", weight=-0.5, name="bonus"), fn("never"))
    (res,) = gen.generate([request(0)])
    assert res.reward_parts["length"] == (3.0,) * 4  # 3 new tokens, no stop token: 3 characters each
    assert res.reward_parts["bonus"] == (1.0, 1.0, None, None) and res.reward_parts["never"] == (None,) * 4
    # 2 * 3 - 0.5 * 1 where `bonus` applies, 2 * 3 where it does not; `never` adds nothing anywhere
    assert res.rewards == (5.5, 5.5, 6.0, 6.0)
    only_none = core(fn("never")).generate([request(0)])[0]
    assert only_none.rewards == (0.0,) * 4  # no function applies: 0.0


def test_an_async_function_is_awaited_in_the_pool():
    (res,) = core(fn("async_match")).generate([request(0)])
    assert isinstance(res, GenerationResult) and set(res.rewards) <= {0.0, 1.0}
    assert res.reward_parts["async_match"] == res.rewards


def test_a_function_past_its_deadline_fails_only_its_group_and_a_fresh_pool_serves_on():
    RELEASE.clear()
    storage = InMemoryRowStorage()
    gen = core(fn("stuck_on_grp1"), timeout_s=0.3, max_workers=2, storage=storage)
    try:
        t0 = time.monotonic()
        results = gen.generate([request(i) for i in range(4)])
        assert time.monotonic() - t0 < 5  # the stuck call was abandoned at its deadline, not awaited
        failed = results[1]
        assert isinstance(failed, RewardFailed)
        assert "gen-3: reward function 'stuck_on_grp1'" in str(failed) and "on group grp1" in str(failed)
        assert "did not finish within reward.timeout_s = 0.3s" in str(failed)
        assert [r.rewards for i, r in enumerate(results) if i != 1] == [(0.5,) * 4] * 3
        stored = {k.rsplit("_g", 1)[0] for k in storage._rows}
        assert stored == {"grp0", "grp2", "grp3"}  # nothing of grp1
        assert gen.scorer.timeouts == 1
        assert gen.generate([request(5)])[0].rewards == (0.5,) * 4  # its thread is still stuck: a new pool
    finally:
        RELEASE.set()


def test_a_function_that_raises_returns_too_few_or_a_nan_fails_its_own_group_naming_it():
    results = core(fn("picky")).generate([request(i) for i in range(5)])
    assert [type(r).__name__ for r in results] == ["GenerationResult"] + ["RewardFailed"] * 3 + ["GenerationResult"]
    raised, short, nan = (str(results[i]) for i in (1, 2, 3))
    assert (
        "reward function 'picky' (tests.unit.test_rewards:picky) on group grp1 raised: ValueError: cannot parse"
        in raised
    )
    assert "on group grp2 returned 1 values for 4 completions" in short
    assert "on group grp3 gave nan for completion 2" in nan


def test_a_per_completion_function_in_the_list_is_adapted_and_names_the_completion_that_failed():
    SEEN.clear()
    gen = core(fn("legacy_raising_on_third", name="match"))
    assert not gen.scorer.inline  # listed in reward.functions: the pool, with per-function values
    results = gen.generate([request(0), request(1)])
    ok = results[0]
    assert ok.reward_parts == {"match": ok.rewards}
    assert "'match'" in str(results[1]) and "raised on completion 2: ZeroDivisionError: boom" in str(results[1])


def test_the_default_reward_is_called_inline_in_the_generating_thread():
    threads = set()

    def legacy(prompt, text):
        threads.add(threading.current_thread().name)
        return positional_match_reward(prompt, text)

    model = TinyGPT(ModelConfig(), TOKENIZER.vocab_size, seed=0)
    gen = GenerationCore(model, InMemoryRowStorage(), legacy, seed=0, version=0)
    (res,) = gen.generate([request(0)])
    assert threads == {threading.current_thread().name}  # no pool hop
    assert res.reward_parts == {}  # the lean default: no per-function values
    assert res.sample == (TOKENIZER.decode(PROMPTS[0].token_ids), res.sample[1], res.rewards[0])


def test_the_sample_is_the_raw_prompt_when_it_is_text():
    text_prompt = dataclasses.replace(PROMPTS[0], raw_prompt="reverse 123")
    scorer = RewardScorer.from_config(None, positional_match_reward, worker="w", decode=TOKENIZER.decode)
    scored = scorer.score(GroupToScore(text_prompt, ["321", "000"], [[1], [2]], "g"))
    assert scored.sample == ("reverse 123", "321", scored.rewards[0])


# ---------------------------------------------------------------- the config refuses bad functions


@pytest.mark.parametrize(
    "override, words",
    [
        (
            f"reward.functions=[{{fn: '{HERE}:three_positional'}}]",
            ["reward.functions[0]", "three_positional", "neither form"],
        ),
        (f"reward.functions=[{{fn: '{HERE}:no_kwargs'}}]", ["reward.functions[0]", "must take **kwargs"]),
        ("reward.functions=[{fn: 'nosuch_reward_mod:f'}]", ["cannot import module 'nosuch_reward_mod'"]),
        ("reward.functions=[{fn: math_verfy}]", ["did you mean 'math_verify'", "exact_match, math_verify"]),
        (f"reward.functions=[{{fn: '{HERE}:CALLS'}}]", ["resolves to a list, which is not callable"]),
        ("reward.functions=[{fn: exact_match}, {fn: exact_match}]", ["2 functions are named 'exact_match'"]),
    ],
)
def test_a_bad_reward_function_is_one_config_error_naming_it(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(str(ROOT / "configs/embedded.yaml"), [override])
    (problem,) = info.value.problems
    assert problem.paths == ("reward.functions",)
    assert all(w in problem.message for w in words), problem.message
    assert "exact_match, math_verify, positional_match, reasoning_gym" in problem.message  # the built-ins


def test_a_builtin_whose_package_is_missing_names_the_package(monkeypatch):
    monkeypatch.setitem(verifiers.BUILTIN_PACKAGES, "exact_match", ("sc_grpo_absent_pkg", "absent-pkg"))
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward.functions=[{fn: exact_match}]"])
    (problem,) = info.value.problems
    assert "the built-in 'exact_match' needs the 'absent-pkg' package, which is not installed" in problem.message


def test_the_legacy_reward_fn_with_a_wrong_signature_is_refused_too():
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"task.reward_fn={HERE}:three_positional"])
    (problem,) = info.value.problems
    assert problem.paths == ("task.reward_fn",) and "neither form of a reward function" in problem.message


def test_an_unknown_or_missing_key_of_a_function_is_reported_where_it_is():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward.functions=[{fn: exact_match, wieght: 2}, {name: x}]"])
    messages = sorted(p.message for p in info.value.problems)
    assert any("reward.functions[0].wieght: unknown key; did you mean 'weight'?" in m for m in messages), messages
    assert any("reward.functions[1].fn: Field required" in m for m in messages), messages


def test_reward_functions_load_from_yaml_and_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "reward:\n  timeout_s: 5\n  functions:\n    - {fn: exact_match, weight: 2}\n"
        f"    - {{fn: '{HERE}:length', name: len, weight: -0.1}}\n"
    )
    cfg = load_config(str(path))
    assert cfg.reward.functions == (
        RewardFunctionConfig("exact_match", None, 2.0),
        RewardFunctionConfig(f"{HERE}:length", "len", -0.1),
    )
    assert cfg.reward.timeout_s == 5.0 and Config().reward.functions == ()


def test_the_two_forms_are_told_apart_by_their_signature():
    assert reward_form(positional_match_reward) == "legacy"
    assert reward_form(recording) == reward_form(async_match) == reward_form(length) == "batched"
    for bad in (three_positional, no_kwargs, lambda *a: 1.0):
        with pytest.raises(TypeError, match="neither form"):
            reward_form(bad)


# ---------------------------------------------------------------- the step records (sim backend)


def _parts(prompt_id, attempt, G):
    """Two functions' values: `a` is the sim reward, `b` applies to the first completion only."""
    return {"a": sim_rewards(prompt_id, attempt, G), "b": (1.0,) + (None,) * (G - 1)}


async def test_step_records_carry_each_functions_mean_over_the_trained_groups():
    cfg = make_cfg(steps=3, P=4, L=0)
    ctl, trainer, storage, summary, err = await run_sim(cfg, Faults(reward_parts=_parts))
    assert err is None
    for rec in summary.history:
        groups = [g for g in ctl.state.ledger.all_records() if g.trained_step == rec["step"]]
        a = [v for g in groups for v in g.reward_parts["a"]]
        assert rec["reward/a/mean"] == pytest.approx(sum(a) / len(a))
        assert rec["reward/b/mean"] == 1.0  # the mean over where it applied, None left out
    await assert_clean_end(ctl, trainer, storage)


@pytest.mark.parametrize("every, with_sample", [(2, [0, 2, 4]), (0, [])])
async def test_a_sample_completion_lands_in_every_nth_step_record_and_in_metrics_jsonl(tmp_path, every, with_sample):
    cfg = make_cfg(steps=5, P=2, L=0, run={"sample_every_steps": every, "output_dir": str(tmp_path)})
    ctl, trainer, storage, summary, err = await run_sim(cfg)
    assert err is None
    assert [r["step"] for r in summary.history if "sample" in r] == with_sample
    run_dir = RunDirectory.create(cfg)
    for rec in summary.history:
        run_dir.append_metrics(rec)
    run_dir.close()
    for rec in run_dir.read_metrics():
        if rec["step"] in with_sample:
            sample = rec["sample"]
            assert sample["prompt"].startswith("prompt p") and sample["completion"].startswith("completion 0 of p")
            assert isinstance(sample["reward"], float)
    assert Config().run.sample_every_steps == 10 and isinstance(RunConfig().sample_every_steps, int)


# ---------------------------------------------------------------- the built-ins


def _math_cases() -> list[dict]:
    with open(ROOT / "tests/data/math_verify_cases.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_math_verify_scores_every_hand_checked_case():
    pytest.importorskip("math_verify", reason="needs the verifiers extra: pip install -e '.[verifiers]'")
    cases = _math_cases()
    assert len(cases) >= 30
    assert {c["expected"] for c in cases} == {0.0, 1.0}
    got = math_verify(["q"] * len(cases), [c["completion"] for c in cases], [c["gold"] for c in cases])
    wrong = [(c["gold"], c["completion"], c["expected"], g) for c, g in zip(cases, got) if g != c["expected"]]
    assert wrong == []


def test_math_verify_runs_in_the_pool_and_a_gold_that_does_not_parse_is_not_applicable():
    pytest.importorskip("math_verify", reason="needs the verifiers extra: pip install -e '.[verifiers]'")
    scorer = RewardScorer.from_config(
        RewardConfig(functions=(RewardFunctionConfig("math_verify"),)), positional_match_reward, worker="w", decode=str
    )
    gold = dataclasses.replace(PROMPTS[0], answer="\\frac{1}{2}")
    scored = scorer.score(GroupToScore(gold, ["$0.5$", "0.6", ""], [[], [], []], "g"))
    assert scored.parts == {"math_verify": (1.0, 0.0, 0.0)} and scored.rewards == (1.0, 0.0, 0.0)
    no_gold = dataclasses.replace(PROMPTS[0], answer="")
    assert scorer.score(GroupToScore(no_gold, ["1", "2"], [[], []], "g")).parts == {"math_verify": (None, None)}
    scorer.close()


def test_the_reasoning_gym_builtin_scores_with_the_entrys_own_task():
    rg = pytest.importorskip("reasoning_gym", reason="needs the verifiers extra: pip install -e '.[verifiers]'")

    entry = rg.create_dataset("spell_backward", size=1, seed=3)[0]
    right = entry["answer"]
    completions = [f"thinking...<answer> {right} </answer>", f"  {right}\n", "<answer>nope</answer>"]
    assert reasoning_gym(["q"] * 3, completions, metadata=[entry] * 3) == [1.0, 1.0, 0.0]
    assert reasoning_gym(["q"] * 3, completions, entry=[entry] * 3) == [1.0, 1.0, 0.0]  # data.reasoning_gym's column
    lines = [f"let me see\n{right}\n", f"{right}\nno wait", ""]
    assert reasoning_gym(["q"] * 3, lines, entry=[entry] * 3, extract=["last_line"] * 3) == [1.0, 0.0, 0.0]
    assert extract_answer("a <answer>x</answer> b <answer>y</answer>") == "y"  # the last tag: the final answer
    assert extract_answer(" a\n b \n\n", "last_line") == "b" and extract_answer(" <answer>x</answer>", "full")
    with pytest.raises(ValueError, match="needs a reasoning-gym item"):
        reasoning_gym(["q"], ["x"], metadata=[{"question": "?"}])
    with pytest.raises(ValueError, match="needs an 'entry'"):
        reasoning_gym(["q"], ["x"], answer=["x"])


def test_the_digit_builtins_match_the_task_rewards():
    scorer = RewardScorer.from_config(
        RewardConfig(functions=(RewardFunctionConfig("positional_match"), RewardFunctionConfig("exact_match"))),
        positional_match_reward,
        worker="w",
        decode=TOKENIZER.decode,
    )
    p = PROMPTS[0]
    texts = [p.answer, p.answer[:2] + "x", "zzz"]
    scored = scorer.score(GroupToScore(p, texts, [[], [], []], "g"))
    assert scored.parts["positional_match"] == tuple(positional_match_reward(p, t) for t in texts)
    assert scored.parts["exact_match"] == (1.0, 0.0, 0.0)
    assert scored.rewards == tuple(positional_match_reward(p, t) + (t == p.answer) for t in texts)
    scorer.close()


def trl_style_reward(prompts, completions, answer, **_):
    """A reward written for TRL's conversational data: reads completion[0]["content"]."""
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]


def test_trl_completions_hand_chat_prompts_completions_as_messages_to_user_functions():
    """reward.trl_completions (issue #54 item 4): with a chat-message prompt, a `module:function`
    reward gets each completion as [{"role": "assistant", "content": text}], as TRL passes it; a
    built-in beside it still gets the text; a string prompt's completions stay text."""
    chat = Prompt("c", (1, 2), "42", raw_prompt=[{"role": "user", "content": "6 x 7?"}])
    functions = (RewardFunctionConfig(f"{__name__}:trl_style_reward"), RewardFunctionConfig("exact_match"))
    scorer = RewardScorer.from_config(
        RewardConfig(functions=functions, trl_completions=True), positional_match_reward, worker="w", decode=str
    )
    scored = scorer.score(GroupToScore(chat, ["42", "41"], [[], []], "g"))
    assert scored.parts == {"trl_style_reward": (1.0, 0.0), "exact_match": (1.0, 0.0)}
    plain = RewardScorer.from_config(RewardConfig(functions=functions), positional_match_reward, worker="w", decode=str)
    with pytest.raises(RewardFailed, match="trl_style_reward"):  # off: the text, which has no [0]["content"]
        plain.score(GroupToScore(chat, ["42", "41"], [[], []], "g"))
    scorer.close()
    plain.close()
