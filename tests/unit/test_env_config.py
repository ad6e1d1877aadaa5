"""Bad environment configs are refused before anything starts, each with a message naming the culprit
(issue 36, acceptance 5): an env.fn that does not import or break the contract, an unreachable env.url,
max_turns < 1, a tool-call format the tokenizer cannot write; and the combinations a run cannot play."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from single_controller.preflight.environment import environment_problems
from single_controller.preflight.loader import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
ROOT_CONFIG = str(ROOT / "configs/env_lookup.yaml")


def flat(err: ConfigError) -> str:
    return " ".join(str(err).split())


def problems(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(ROOT_CONFIG, overrides)
    return flat(info.value)


class NoStep:
    async def reset(self, item):
        return ""


class SyncStep:
    async def reset(self, item):
        return ""

    def step(self, action):
        return None


def test_the_shipped_environment_configs_load():
    for name in ("env_lookup.yaml", "env_guess.yaml"):
        assert load_config(str(ROOT / "configs" / name)).env.fn is not None


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["env.fn=nosuch_env_module:Env"], "nosuch_env_module"),
        (["env.fn=tests.unit.test_env_config:Missing"], "Missing"),
        (["env.fn=tests.unit.test_env_config:NoStep"], "step"),
        (["env.fn=tests.unit.test_env_config:SyncStep"], "async"),
        (["env.max_turns=0"], "env.max_turns"),
        (["env.url=http://127.0.0.1:9"], "env.fn and env.url are both set"),
        (["reward.functions=[{fn: exact_match}]"], "reward.functions with an environment"),
        (["backend.generation=sim", "backend.trainer=sim", "storage.kind=memory"], "cannot play multi-turn"),
    ],
)
def test_a_bad_environment_config_is_refused_naming_what_is_wrong(overrides, expected):
    assert expected in problems(overrides)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


def test_an_unreachable_env_url_is_refused_by_the_machine_checks_naming_it():
    url = f"http://127.0.0.1:{_closed_port()}"
    cfg = load_config(ROOT_CONFIG, ["env.fn=null", f"env.url={url}", "env.timeout_s=2"])
    found = [p for p in environment_problems(cfg) if "env.url" in p.paths]
    assert len(found) == 1 and url in found[0].message, found


def test_a_tool_call_format_the_tokenizer_cannot_write_is_refused():
    cfg = load_config(ROOT_CONFIG, ["env.tool_call=hermes"])  # `<tool_call>` is not in the digit alphabet
    found = [p for p in environment_problems(cfg) if "env.tool_call" in p.paths]
    assert len(found) == 1 and "<" in found[0].message, found
    assert not [p for p in environment_problems(load_config(ROOT_CONFIG)) if "env.tool_call" in p.paths]
