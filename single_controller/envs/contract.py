"""The environment contract of a multi-turn rollout (docs/environments.md).

An episode is one row of a prompt group; the generation worker owns the tokens, the environment sees
only text:

    env = factory()                         # one instance per episode
    first = await env.reset(item)           # str: the first observation ("" = none)
    out = await env.step(Action(text, tool_call))   # per policy turn, until out.done or max_turns
    await env.close()

Every call has a deadline (`env.timeout_s`); an error or a missed deadline is an `EnvFailed`, never a
zero reward. Reaching `max_turns` without `done` is an outcome, not an error (`env.truncated_reward`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EpisodeItem:
    """What `reset` gets: the dataset row the episode starts from."""

    prompt_id: str
    prompt: Any  # the prompt as the dataset gave it (str, or a list of {role, content} messages)
    answer: str = ""
    columns: Mapping[str, Any] = field(default_factory=dict)
    attempt: int = 0  # the episode's retry attempt (0 = first), for environments that seed from it
    index: int = 0  # the episode's row in its group (0..G-1)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # parsed arguments: a dict (JSON formats) or the raw argument string
    # Set when the action tried a call the parser could not read (e.g. a `<tool_call>` with bad JSON):
    # `arguments` is then the raw text; the environment answers with an error observation.
    error: str | None = None


@dataclass(frozen=True)
class Action:
    text: str  # the policy's turn as decoded text, without its final stop token
    tool_call: ToolCall | None = None


@dataclass(frozen=True)
class StepOutcome:
    observation: str = ""  # appended to the sequence when not done (must encode to >= 1 token)
    reward: float | None = None  # required when done
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)  # small, JSON-able: logged, never trained on

    def __post_init__(self) -> None:
        if self.done and self.reward is None:
            raise ValueError("a final StepOutcome (done=True) needs a reward")


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (async; a transport adds the deadlines)."""

    async def reset(self, item: EpisodeItem) -> str: ...

    async def step(self, action: Action) -> StepOutcome: ...

    # Optional: `async def close(self) -> None`, called once when the episode ends (also after a failure).


class EnvFailed(RuntimeError):
    """An environment call failed or missed its deadline; names the call, the episode and why."""

    def __init__(self, what: str, episode: str, cause: str):
        super().__init__(f"environment {what} for episode {episode} failed: {cause}")
        self.what, self.episode, self.cause = what, episode, cause


class EnvContractError(TypeError):
    """An environment class or server that does not satisfy the contract (raised before start-up)."""
