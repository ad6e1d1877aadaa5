"""Multi-turn episodes: a generation engine's tokens against an environment (`single_controller/envs`).

`EpisodeRunner.run_group(request, engine)` plays a group's G episodes concurrently, each one
sequence growing turn by turn: prompt, then [policy turn][observation]... A policy turn keeps the
exact ids, logprobs and versions the engine sampled; its decoded text is the action (tool calls:
`envs/tool_calls.py`); observations are encoded once, as inserted. The stored row's `response_mask`
is True exactly on policy tokens. An episode ends at `done`, after `env.max_turns`, or when the next
turn would not fit (`truncated_reward`); one with no room for its first token fails its group with
`ContextFull`. A failing environment restarts the episode (`env.retry_backoff_s`, up to
`env.max_attempts`), then fails the group with `EnvironmentFailed`: never a zero reward.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from single_controller.backends.common.scoring import finite
from single_controller.config.schema import EnvConfig
from single_controller.data.tokenizer import RunTokenizer
from single_controller.deadlines import DeadlineExceeded, within
from single_controller.envs.contract import Action, EnvFailed, Environment, EpisodeItem, StepOutcome
from single_controller.protocols import ContextFull, EnvironmentFailed
from single_controller.types import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from single_controller.envs.tool_calls import ToolCallParser


@dataclass(frozen=True)
class Continuation:
    """What an engine sampled for one sequence: its new ids, their logprobs, and the policy version
    that sampled each (an engine that updates weights mid-request, as vLLM under `keep`, labels
    each token)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]


class TurnEngine(Protocol):
    """The engine side of an episode: continue one sequence by at most `max_new` tokens, ending at
    any of `stop_ids`. Concurrent calls may be batched by the engine."""

    max_seq_len: int

    async def continue_sequence(
        self, ids: Sequence[int], max_new: int, request: GenerationRequest, stop_ids: tuple[int, ...]
    ) -> Continuation: ...


@dataclass
class Episode:
    """One finished episode: its row and what the records count."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    truncated: bool = False
    env_s: float = 0.0  # seconds spent waiting for the environment
    attempts: int = 1
    last_action: str = ""

    @property
    def policy_tokens(self) -> int:
        return sum(self.mask)

    @property
    def observation_tokens(self) -> int:
        return len(self.mask) - self.policy_tokens

    def add(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], *, policy: bool) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"{len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
        self.response_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.mask.extend([policy] * len(ids))
        self.versions.extend(versions)


class ObservationEncoder:
    """The exact ids an observation is inserted as. Without a chat template: the observation's own
    tokens. With one: the template's text between the end of the policy's turn and the start of its
    next one (the observation wrapped as a `role` message, then the generation prompt), tokenized
    once; when the policy's turn ended without a stop token, the turn's closing tokens come first."""

    _SENTINEL = "\x00sc-grpo-turn\x00"

    def __init__(self, tokenizer: RunTokenizer):
        self.tokenizer = tokenizer
        self._tok = getattr(tokenizer, "tok", None) if tokenizer.has_chat_template else None
        self._before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self._SENTINEL}]
        self._stop_text_len = 0  # the template's copy of the stop token after a turn (skipped when the policy wrote it)
        if self._tok is not None:
            closed = str(self._tok.apply_chat_template(self._before, tokenize=False, add_generation_prompt=False))
            end = closed[closed.index(self._SENTINEL) + len(self._SENTINEL) :]
            stops = (self._tok.decode([i]) for i in tokenizer.eos_ids)
            self._stop_text_len = next((len(eos) for eos in stops if eos and end.startswith(eos)), 0)

    def encode(self, text: str, *, role: str, stopped: bool) -> list[int]:
        if self._tok is None:
            return self.tokenizer.encode(text)
        opened = str(
            self._tok.apply_chat_template(
                [*self._before, {"role": role, "content": text}], tokenize=False, add_generation_prompt=True
            )
        )
        cut = opened.index(self._SENTINEL) + len(self._SENTINEL) + (self._stop_text_len if stopped else 0)
        return self.tokenizer.encode(opened[cut:])


class EpisodeRunner:
    """Plays prompt groups' episodes against `factory()` environments (one per episode attempt)."""

    def __init__(
        self,
        cfg: EnvConfig,
        factory: Callable[[], Environment],
        tokenizer: RunTokenizer,
        parser: ToolCallParser,
        *,
        default_max_new: int,
        name: str = "generation",
    ):
        self.cfg = cfg
        self.factory = factory
        self.tokenizer = tokenizer
        self.parser = parser
        self.encoder = ObservationEncoder(tokenizer)
        self.max_per_turn = cfg.max_tokens_per_turn or default_max_new
        self.stop_ids = tuple(tokenizer.eos_ids)
        self.name = name

    async def run_group(self, request: GenerationRequest, engine: TurnEngine) -> list[Episode]:
        """The group's G episodes, or `EnvironmentFailed` when one of them ran out of attempts, or
        `ContextFull` when one had no room for a policy token (the others are cancelled: a group
        trains whole or not at all)."""
        tasks = [
            asyncio.create_task(self._episode(request, i, engine), name=f"{request.group_id}#{i}")
            for i in range(request.sampling.n)
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # cancelled, or one episode failed: the others are not wanted
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks)
        for t in tasks:
            error = None if t.cancelled() else t.exception()
            if isinstance(error, _AttemptsExhausted):
                raise EnvironmentFailed(
                    f"{self.name}: group {request.group_id}: episode {error.index} failed {error.attempts} "
                    f"time(s), the last: {error.error}"
                ) from error.error
            if error is not None:
                raise error  # ContextFull, the engine's (GenerationFailed) or a bug: not the environment's
        return [t.result() for t in tasks]

    async def _episode(self, request: GenerationRequest, index: int, engine: TurnEngine) -> Episode:
        last: EnvFailed | None = None
        for attempt in range(self.cfg.max_attempts):
            env = self.factory()
            item = self._item(request, index, attempt)
            try:
                episode = await self._play(env, item, request, engine)
                episode.attempts = attempt + 1
                return episode
            except EnvFailed as e:
                last = e
            finally:
                await self._close(env, item)
            if attempt + 1 < self.cfg.max_attempts:  # a restarting server gets time to come back
                await asyncio.sleep(self._retry_backoff_s(attempt))
        assert last is not None
        raise _AttemptsExhausted(index, self.cfg.max_attempts, last)

    def _retry_backoff_s(self, attempt: int) -> float:
        """The pause after failed attempt `attempt` (0-based): `env.retry_backoff_s`, doubled each time."""
        return self.cfg.retry_backoff_s * 2**attempt

    def _item(self, request: GenerationRequest, index: int, attempt: int) -> EpisodeItem:
        p = request.prompt
        raw = p.raw_prompt if p.raw_prompt is not None else self.tokenizer.decode(p.token_ids)
        return EpisodeItem(p.prompt_id, raw, p.answer, dict(p.columns), attempt=attempt, index=index)

    async def _play(
        self, env: Environment, item: EpisodeItem, request: GenerationRequest, engine: TurnEngine
    ) -> Episode:
        first = await self._call(env.reset(item), "reset", item)
        if not isinstance(first, str):
            raise EnvFailed("reset", _episode_name(item), f"returned {type(first).__name__}, not a str")
        prompt = list(request.prompt.token_ids)
        if first:
            prompt += self.encoder.encode(first, role="user", stopped=True)
        ep = Episode(prompt_ids=prompt)
        seq = list(prompt)
        while ep.turns < self.cfg.max_turns:
            budget = min(self.max_per_turn, engine.max_seq_len - len(seq))
            if budget < 1:
                if not ep.turns:  # not one policy token: nothing to train, and not the policy's doing
                    raise ContextFull(
                        f"{self.name}: group {request.group_id}: episode {_episode_name(item)}: the prompt "
                        f"({len(request.prompt.token_ids)} tokens) and the environment's first observation "
                        f"({len(prompt) - len(request.prompt.token_ids)} tokens) fill the model's "
                        f"{engine.max_seq_len} positions: no room for one policy token"
                    )
                break
            out = await engine.continue_sequence(seq, budget, request, self.stop_ids)
            ep.add(out.ids, out.logprobs, out.versions, policy=True)
            seq.extend(out.ids)
            ep.turns += 1
            stopped = bool(out.ids) and out.ids[-1] in self.stop_ids
            text = self.tokenizer.decode(out.ids[:-1] if stopped else out.ids)
            ep.last_action = text
            call = self.parser.parse(text)
            ep.tool_calls += call is not None
            step = await self._step(env, Action(text, call), item, ep)
            if step.done:
                assert step.reward is not None  # StepOutcome checks it
                ep.reward = float(step.reward)
                return ep
            if ep.turns >= self.cfg.max_turns:  # no turn left to read an observation
                ep.truncated = True
                ep.reward = self.cfg.truncated_reward if step.reward is None else float(step.reward)
                return ep
            obs = self.encoder.encode(step.observation, role="tool" if call else "user", stopped=stopped)
            if not obs:
                raise EnvFailed("step", _episode_name(item), "returned an empty observation without done")
            if len(seq) + len(obs) >= engine.max_seq_len:
                break  # no room for the observation and one more token
            # observation tokens carry the version of the turn before them (never trained)
            ep.add(obs, [0.0] * len(obs), [ep.versions[-1]] * len(obs), policy=False)
            seq.extend(obs)
        ep.truncated = True
        ep.reward = self.cfg.truncated_reward
        return ep

    async def _step(self, env: Environment, action: Action, item: EpisodeItem, ep: Episode) -> StepOutcome:
        started = time.perf_counter()
        try:
            out = await self._call(env.step(action), "step", item)
        finally:
            ep.env_s += time.perf_counter() - started
        if not isinstance(out, StepOutcome):
            raise EnvFailed("step", _episode_name(item), f"returned {type(out).__name__}, not a StepOutcome")
        if out.done and finite(out.reward) is None:
            raise EnvFailed("step", _episode_name(item), f"gave the reward {out.reward!r}, not a finite number")
        return out

    async def _call(self, aw: Any, what: str, item: EpisodeItem) -> Any:
        try:
            return await within(aw, self.cfg.timeout_s, f"environment {what} of episode {_episode_name(item)}")
        except EnvFailed:
            raise
        except DeadlineExceeded as e:
            raise EnvFailed(what, _episode_name(item), f"no answer within env.timeout_s={e.seconds:g}s") from e
        except Exception as e:  # the environment's error, whatever it is
            raise EnvFailed(what, _episode_name(item), repr(e)) from e

    async def _close(self, env: Environment, item: EpisodeItem) -> None:
        close = getattr(env, "close", None)
        if close is None:
            return
        try:
            await within(close(), self.cfg.timeout_s, f"environment close of episode {_episode_name(item)}")
        except Exception:  # noqa: BLE001 - the episode's outcome stands; a leak is the environment's
            pass


def env_factory(cfg: EnvConfig) -> Callable[[], Environment]:
    """A fresh environment per episode attempt: in-process (`env.fn`) or over HTTP (`env.url`)."""
    if cfg.url is not None:
        from single_controller.envs.http_client import HttpEnvironment

        url = cfg.url
        return lambda: HttpEnvironment(url, timeout_s=cfg.timeout_s, args=cfg.args)
    from single_controller.envs.inprocess import load_env_factory

    return load_env_factory(cfg)


def episode_runner(cfg: EnvConfig, tokenizer: RunTokenizer, *, default_max_new: int, name: str) -> EpisodeRunner:
    from single_controller.envs.tool_calls import ToolCallParser

    parser = ToolCallParser.from_config(cfg, tokenizer)
    return EpisodeRunner(cfg, env_factory(cfg), tokenizer, parser, default_max_new=default_max_new, name=name)


class _AttemptsExhausted(Exception):
    def __init__(self, index: int, attempts: int, error: EnvFailed):
        super().__init__(str(error))
        self.index, self.attempts, self.error = index, attempts, error


def _episode_name(item: EpisodeItem) -> str:
    return f"{item.prompt_id}#{item.index}" + (f" (attempt {item.attempt + 1})" if item.attempt else "")


def rows_of(episodes: Sequence[Episode]) -> dict[str, list[torch.Tensor]]:
    """The stored columns of a group's episodes (one row each)."""
    return {
        "prompt_ids": [torch.tensor(e.prompt_ids, dtype=torch.int64) for e in episodes],
        "response_ids": [torch.tensor(e.response_ids, dtype=torch.int64) for e in episodes],
        "gen_logprobs": [torch.tensor(e.logprobs, dtype=torch.float32) for e in episodes],
        "response_mask": [torch.tensor(e.mask, dtype=torch.bool) for e in episodes],
        "token_versions": [torch.tensor(e.versions, dtype=torch.int64) for e in episodes],
    }


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """What a group's episodes add to the records (sums over the group; the controller averages)."""
    return {
        "episodes": float(len(episodes)),
        "turns": float(sum(e.turns for e in episodes)),
        "tool_calls": float(sum(e.tool_calls for e in episodes)),
        "env_s": sum(e.env_s for e in episodes),
        "policy_tokens": float(sum(e.policy_tokens for e in episodes)),
        "observation_tokens": float(sum(e.observation_tokens for e in episodes)),
        "truncated": float(sum(e.truncated for e in episodes)),
        "retries": float(sum(e.attempts - 1 for e in episodes)),
    }


def episode_result(
    request: GenerationRequest, episodes: Sequence[Episode], tokenizer: RunTokenizer
) -> GenerationResult:
    """A group's result: its rewards and episode statistics; its version span over the policy tokens
    only (an observation carries the version of the turn before it and is never trained)."""
    versions = [v for e in episodes for v, m in zip(e.versions, e.mask) if m]
    if not versions:  # (`EpisodeRunner` fails such a group before it ends)
        raise ContextFull(f"group {request.group_id}: no episode sampled a token (the prompt fills the context)")
    rewards = tuple(e.reward for e in episodes)
    return GenerationResult(
        group_id=request.group_id,
        rewards=rewards,
        response_lengths=tuple(len(e.response_ids) for e in episodes),
        prompt_length=len(episodes[0].prompt_ids),
        version_start=min(versions),
        version_end=max(versions),
        sample=(tokenizer.decode(episodes[0].prompt_ids), transcript(tokenizer, episodes[0]), rewards[0]),
        episode_stats=episode_stats(episodes),
        truncated=tuple(e.truncated for e in episodes),
    )


def transcript(tokenizer: RunTokenizer, e: Episode) -> str:
    """An episode's response for logs: policy turns as text, observations in [brackets]."""
    parts: list[str] = []
    run: list[int] = []
    policy = None
    for tok, m in zip(e.response_ids, e.mask):
        if m != policy and run:
            parts.append(tokenizer.decode(run) if policy else f"[{tokenizer.decode(run)}]")
            run = []
        policy = m
        run.append(tok)
    if run:
        parts.append(tokenizer.decode(run) if policy else f"[{tokenizer.decode(run)}]")
    return "".join(parts)
