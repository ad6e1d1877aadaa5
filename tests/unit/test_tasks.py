"""Tokenizer, digit tasks, rewards and `load_callable` (pure, no torch models)."""

import sys
import types

import pytest

from single_controller.data.tasks import (
    TASKS,
    TOKENIZER,
    copy_digits,
    exact_match_reward,
    load_callable,
    load_task,
    positional_match_reward,
    reverse_digits,
)
from single_controller.types import Prompt


def test_tokenizer_round_trip_one_char_per_token():
    text = "^0123456789>$_"
    ids = TOKENIZER.encode(text)
    assert len(ids) == len(text)
    assert TOKENIZER.decode(ids) == text
    assert 16 <= TOKENIZER.vocab_size <= 32
    assert len({TOKENIZER.pad_id, TOKENIZER.bos_id, TOKENIZER.eos_id}) == 3
    with pytest.raises(ValueError, match="not in the vocabulary"):
        TOKENIZER.encode("12a")


def test_reverse_and_copy_prompts():
    rev = reverse_digits(50, 3, seed=7)
    cp = copy_digits(50, 3, seed=7)
    assert [p.prompt_id for p in rev] == [f"p{i:05d}" for i in range(50)]
    for r, c in zip(rev, cp):
        text = TOKENIZER.decode(r.token_ids)
        assert text[0] == "^" and text[-1] == ">" and len(text) == 5  # BOS d1 d2 d3 >
        digits = text[1:-1]
        assert r.answer == digits[::-1] and c.answer == digits
        assert r.token_ids == c.token_ids  # same seed, same digits
    assert reverse_digits(50, 3, seed=7) == rev  # deterministic
    assert reverse_digits(50, 3, seed=8) != rev
    assert TASKS["reverse_digits"] is reverse_digits and load_task("copy_digits") is copy_digits


def test_positional_match_reward():
    p = Prompt("p0", (1, 2), answer="321")
    assert positional_match_reward(p, "321") == 1.0
    assert positional_match_reward(p, "324") == pytest.approx(2 / 3)
    assert positional_match_reward(p, "3") == pytest.approx(1 / 3)  # missing positions are wrong
    assert positional_match_reward(p, "3219") == 1.0  # extra characters are ignored
    assert positional_match_reward(p, "123") == pytest.approx(1 / 3)  # the middle digit only
    assert exact_match_reward(p, "321") == 1.0 and exact_match_reward(p, "3219") == 0.0


def test_load_callable():
    assert load_callable("single_controller.data.tasks:positional_match_reward") is positional_match_reward
    with pytest.raises(ImportError, match="cannot import module 'no_such_module_xyz'"):
        load_callable("no_such_module_xyz:f")
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        load_callable("single_controller.data.tasks:nope")
    with pytest.raises(ValueError, match="module:function"):
        load_callable("single_controller.data.tasks.positional_match_reward")
    with pytest.raises(TypeError, match="not callable"):
        load_callable("single_controller.data.tasks:TASKS")
    with pytest.raises(KeyError, match="unknown task"):
        load_task("addition")


def _repeating_dataset(n, d, seed):
    """A custom `module:function` dataset whose ids repeat: p1 twice, p3 three times."""
    ids = ["p0", "p1", "p2", "p1", "p3", "p4", "p3", "p3"]
    return [Prompt(pid, (1, 2, i), "x") for i, pid in enumerate(ids)]


async def test_a_custom_dataset_that_repeats_prompt_ids_is_refused_as_it_loads_naming_them(monkeypatch):
    from single_controller.preflight.loader import load_config
    from single_controller.runtime.actor_host import ControllerHost, make_dataloader

    monkeypatch.setitem(sys.modules, "_sc_dup_data", types.SimpleNamespace(prompts=_repeating_dataset))
    cfg = load_config(None, ["task.name=_sc_dup_data:prompts", "backend.generation=sim", "backend.trainer=sim"])
    said = "task dataset '_sc_dup_data:prompts' has 2 duplicated prompt id(s): 'p1' (2 times), 'p3' (3 times)"
    with pytest.raises(ValueError) as info:
        make_dataloader(cfg)
    assert said in str(info.value)
    # the run's setup refuses it before it starts any worker
    host = ControllerHost(cfg)
    started = []
    monkeypatch.setattr(host, "_sim_workers", lambda: started.append("workers"))
    with pytest.raises(ValueError, match="duplicated prompt id"):
        await host.setup()
    assert started == []
