"""Generation: sample prompt groups, score them next to the tokens, store the rows.

`GenerationCore` (no Ray) runs one sampling pass per distinct (prompt length, sampling settings),
decodes, scores each group (`backends/common/scoring.py`) and writes all rollout rows of a batch in
ONE put, without per-row tags (a key names its group, `token_versions` its weights); eval requests
are never stored; a group whose reward failed is answered with `RewardFailed`, unstored, alone.
`GenerationActor` is the asyncio worker around it: two lanes (eval first), one batching loop of up to
`max_batch_groups` groups, version-gated (`protocols.VersionGated`); weights change only under
`_weights_lock`, so a batch sees one version. `sleep` / `wake` serve an elastic shrink.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from replay.storage import LazyRowStorage
from single_controller.backends.common.actors import EarlyCancels
from single_controller.backends.common.colocation import turns_from_env
from single_controller.backends.common.episodes import (
    Continuation,
    Episode,
    EpisodeRunner,
    episode_result,
    episode_runner,
    rows_of,
)
from single_controller.backends.common.scoring import GroupToScore, RewardScorer, Scored
from single_controller.backends.common.weight_broadcast import GroupAddress, WeightReceiver
from single_controller.backends.common.weights import WeightSnapshot, load_snapshot, resolve_snapshot
from single_controller.backends.common.worker_logs import redirect_output
from single_controller.backends.torch.model import TinyGPT, load_hf_policy, state_module
from single_controller.backends.torch.sampling import row_uniforms, sample
from single_controller.backends.torch.turn_batches import TurnBatcher, sample_continuations
from single_controller.config.schema import EnvConfig, ModelConfig, RewardConfig, env_enabled
from single_controller.data.tasks import TOKENIZER
from single_controller.data.tokenizer import RunTokenizer, load_tokenizer
from single_controller.protocols import EnvironmentFailed, GenerationFailed, RewardFailed
from single_controller.types import GenerationRequest, GenerationResult, WeightsHandle, cut_by_length


@dataclass(frozen=True)
class GenerationStatistics:
    version: int | None
    batches: int
    groups: int
    rows: int
    tokens: int
    pending: int  # queued, not yet in a batch (actor only)
    running: int  # in the batch being sampled (actor only)
    weight_updates: int
    last_batch_s: float
    eval_requests: int = 0  # eval requests served (their rows count in `rows`/`tokens`, never stored)
    reward_failures: int = 0  # groups answered with RewardFailed (not counted in `groups`, none stored)
    env_failures: int = 0  # episode groups answered with EnvironmentFailed (none stored)


# One sampled row: (token ids [n], logprobs [n], mask [n], response text, n).
_Row = tuple[torch.Tensor, torch.Tensor, torch.Tensor, str, int]


def _result(r: GenerationRequest, rows: list[_Row], scored: Scored, version: int) -> GenerationResult:
    return GenerationResult(
        group_id=r.group_id,
        rewards=scored.rewards,
        response_lengths=tuple(n for *_, n in rows),
        prompt_length=len(r.prompt.token_ids),
        version_start=version,
        version_end=version,
        reward_parts=scored.parts,
        sample=scored.sample,
        truncated=tuple(cut_by_length(ids[-1:].tolist(), r.sampling.stop_token_ids) for ids, *_ in rows),
    )


def _rows(requests: Sequence[GenerationRequest], idx: list[int]) -> list[tuple[str, int]]:
    """(sample id, index in the group) of every row of a pass, in the pass's order."""
    return [(requests[i].sample_id or requests[i].group_id, j) for i in idx for j in range(requests[i].sampling.n)]


class GenerationCore:
    def __init__(
        self,
        policy: nn.Module,
        storage: Any,
        reward_fn: Callable | str,
        *,
        reward: RewardConfig | None = None,
        tokenizer: RunTokenizer = TOKENIZER,
        seed: int = 0,
        version: int | None = None,
        name: str = "torch generation",
        sampling_seed: int = 0,
    ):
        self.name = name  # for the errors it reports
        self.policy = policy
        self.storage = storage  # has put_rows_sync(keys, columns)
        self.tokenizer = tokenizer
        # `reward.functions`, or `reward_fn` (task.reward_fn) alone when there are none
        self.scorer = RewardScorer.from_config(reward, reward_fn, worker=name, decode=tokenizer.decode)
        self.generator = torch.Generator().manual_seed(seed)  # multi-turn passes
        self.sampling_seed = sampling_seed  # single-turn rows: seeded per group and row (`row_uniforms`)
        self.version = version  # policy version of `policy`'s weights (None: none loaded yet)
        self._counts = dict(batches=0, groups=0, rows=0, tokens=0, weight_updates=0, eval_requests=0, reward_failures=0)
        self._last_batch_s = 0.0
        # Cancel vs. write: a cancelled group's rows must never be written after its cancel returns.
        # Both take this lock; the write skips groups cancelled before it.
        self._write_lock = threading.Lock()
        self.running_ids: set[str] = set()  # groups of the batch being sampled (set on the actor's loop)
        self._cancelled: set[str] = set()  # running groups cancelled: not to be written
        self._written: set[str] = set()  # running groups whose rows are already stored
        self.env_failures = 0  # episode groups answered with EnvironmentFailed (multi-turn)
        self._shapes: list[tuple[torch.Size, torch.dtype]] = []  # the parameters' while dropped (a sleep)

    def end_batch(self) -> None:
        with self._write_lock:
            self.running_ids, self._cancelled, self._written = set(), set(), set()

    def cancel(self, group_id: str) -> bool:
        """After this returns no row of `group_id` is written; True if its rows were already stored
        (the caller clears them)."""
        with self._write_lock:
            if group_id in self._written:
                return True
            if group_id in self.running_ids:
                self._cancelled.add(group_id)
            return False

    def load_weights(self, snapshot: WeightSnapshot) -> None:
        """Apply a resolved snapshot (numpy buckets) and take its version."""
        v = snapshot.manifest.version
        if self.version is not None and v < self.version:
            raise ValueError(f"weights v{v} are older than the loaded v{self.version}")
        load_snapshot(state_module(self.policy), snapshot)
        self.version = v
        self._counts["weight_updates"] += 1

    def drop_weights(self) -> None:
        """Free the parameters' memory (a sleep): each keeps its place in the module with no storage,
        and the version is forgotten, so nothing is served until `restore_weights` and a load."""
        params = list(state_module(self.policy).parameters())
        self._shapes = [(p.shape, p.dtype) for p in params]
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype)
        self.version = None

    def restore_weights(self) -> None:
        """Give the parameters storage again (uninitialized: `version` stays None until a load)."""
        for p, (shape, dtype) in zip(state_module(self.policy).parameters(), self._shapes):
            p.data = torch.empty(shape, dtype=dtype)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult | RewardFailed | None]:
        """Sample, score and store a batch; one entry per request (None: cancelled meanwhile, not
        stored; `RewardFailed`: its reward function failed, not stored)."""
        started = time.perf_counter()
        if self.version is None:
            raise GenerationFailed("no weights loaded yet (update_weights first)")
        for r in requests:
            if not r.eval and len(r.row_keys) != r.sampling.n:
                raise ValueError(f"group {r.group_id}: {len(r.row_keys)} row keys for n={r.sampling.n}")
        version = self.version
        # One sampling pass per (prompt length, settings): rows of a pass share their prompt length.
        passes: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, r in enumerate(requests):
            s = r.sampling
            passes[(len(r.prompt.token_ids), s.temperature, s.top_p, s.max_new_tokens, s.stop_token_ids)].append(i)
        # Per request: (token ids [n], logprobs [n], mask [n], response text, n) of each row. The
        # tensors are split from the pass's outputs in one call per field (slicing them row by row
        # cost more than the rows' data); every storage copies what it is given.
        responses: list[list[_Row]] = [[] for _ in requests]
        for (_, temperature, top_p, max_new, stop), idx in passes.items():
            prompt_ids = torch.tensor(
                [requests[i].prompt.token_ids for i in idx for _ in range(requests[i].sampling.n)], dtype=torch.long
            )  # [sum n, Tp]
            greedy = temperature == 0  # logprobs then reported at temperature 1
            out = sample(
                self.policy,
                prompt_ids,
                max_new_tokens=max_new,
                temperature=1.0 if greedy else temperature,
                top_p=top_p,
                stop_token_ids=stop,
                pad_id=self.tokenizer.pad_id,
                greedy=greedy,
                uniforms=None if greedy else row_uniforms(self.sampling_seed, _rows(requests, idx), max_new),
            )
            token_lists, lengths = out.tokens.tolist(), out.lengths.tolist()
            generated = torch.arange(out.tokens.shape[1])[None, :] < out.lengths[:, None]  # [B, N]
            ids, lps, masks = (torch.split(x[generated], lengths) for x in (out.tokens, out.logprobs, out.mask))
            row = 0
            for i in idx:
                for _ in range(requests[i].sampling.n):
                    n = lengths[row]
                    # The reward sees the text without a final stop token.
                    text_ids = token_lists[row][: n - 1 if n and token_lists[row][n - 1] in stop else n]
                    responses[i].append((ids[row], lps[row], masks[row], self.tokenizer.decode(text_ids), n))
                    row += 1

        scores = self._score(requests, responses)  # outside the lock: a slow reward never holds up a cancel
        with self._write_lock:
            return self._store(requests, responses, scores, version, started)

    def _store(
        self,
        requests: Sequence[GenerationRequest],
        responses: list[list[_Row]],
        scores: list[Scored | RewardFailed | None],
        version: int,
        started: float,
    ) -> list[GenerationResult | RewardFailed | None]:
        """Under the write lock: store the rows of every group not cancelled meanwhile and scored (a
        group whose reward failed is answered with its `RewardFailed`, alone)."""
        keys: list[str] = []
        results: list[GenerationResult | RewardFailed | None] = []
        lengths: list[int] = []
        cols: dict[str, list] = {
            k: [] for k in ("prompt_ids", "response_ids", "gen_logprobs", "response_mask", "reward")
        }
        eval_rows = eval_tokens = n_eval = 0
        for r, rows, scored in zip(requests, responses, scores):
            if r.group_id in self._cancelled:
                scored = None  # cancelled, maybe while it was scored
            if not isinstance(scored, Scored):
                results.append(scored)  # None (cancelled) or RewardFailed (this group alone): no row stored
                continue
            results.append(_result(r, rows, scored, version))
            if r.eval:  # scored, never stored
                n_eval += 1
                eval_rows += len(rows)
                eval_tokens += sum(n for *_, n in rows)
                continue
            prompt = torch.tensor(r.prompt.token_ids, dtype=torch.long)
            cols["prompt_ids"].extend(prompt for _ in rows)
            cols["response_ids"].extend(ids for ids, *_ in rows)
            cols["gen_logprobs"].extend(lp for _, lp, *_ in rows)
            cols["response_mask"].extend(mask for _, _, mask, *_ in rows)
            lengths.extend(n for *_, n in rows)
            cols["reward"].extend(scored.rewards)
            keys.extend(r.row_keys)
        if keys:
            columns: dict[str, Any] = dict(cols)
            columns["token_versions"] = list(
                torch.split(torch.full((sum(lengths),), version, dtype=torch.int64), lengths)
            )
            columns["reward"] = torch.tensor(cols["reward"], dtype=torch.float32)
            self.storage.put_rows_sync(keys, columns)
        answered = [res for res in results if isinstance(res, GenerationResult)]
        self._written.update(res.group_id for res in answered)
        self._counts["batches"] += 1
        self._counts["groups"] += len(answered) - n_eval
        self._counts["reward_failures"] += sum(isinstance(res, RewardFailed) for res in results)
        self._counts["eval_requests"] += n_eval
        self._counts["rows"] += len(keys) + eval_rows
        self._counts["tokens"] += sum(lengths) + eval_tokens
        self._last_batch_s = time.perf_counter() - started
        return results

    def _score(
        self, requests: Sequence[GenerationRequest], responses: list[list[_Row]]
    ) -> list[Scored | RewardFailed | None]:
        """Each group's scores: None for a group cancelled while sampling (no result wanted), its
        `RewardFailed` for one whose reward function failed."""
        live = [i for i, r in enumerate(requests) if r.group_id not in self._cancelled]
        groups = [
            GroupToScore(
                requests[i].prompt,
                [text for *_, text, _ in responses[i]],
                [ids for ids, *_ in responses[i]],
                requests[i].group_id,
            )
            for i in live
        ]
        out: list[Scored | RewardFailed | None] = [None] * len(requests)
        for i, scored in zip(live, self.scorer.score_groups(groups)):
            out[i] = scored
        return out

    # -- multi-turn episodes (`env`): `backends/torch/turn_batches.py`, `backends/common/episodes.py` --

    def continue_pass(self, asks: list) -> list[Continuation]:
        """One turn of every asking episode (the worker holds its weights lock)."""
        if self.version is None:
            raise GenerationFailed("no weights loaded yet (update_weights first)")
        out = sample_continuations(
            self.policy, asks, self.version, pad_id=self.tokenizer.pad_id, generator=self.generator
        )
        self._counts["batches"] += 1
        self._counts["tokens"] += sum(len(c.ids) for c in out)
        return out

    def store_episodes(self, r: GenerationRequest, episodes: Sequence[Episode]) -> GenerationResult | None:
        """Store a group's finished episodes (nothing for an eval request) unless it was cancelled
        meanwhile (None); its result."""
        result = episode_result(r, episodes, self.tokenizer)
        with self._write_lock:
            if r.group_id in self._cancelled:
                return None
            if not r.eval:
                columns: dict[str, Any] = dict(rows_of(episodes))
                columns["reward"] = torch.tensor(result.rewards, dtype=torch.float32)
                self.storage.put_rows_sync(r.row_keys, columns)
                self._written.add(r.group_id)
            self._counts["groups"] += not r.eval
            self._counts["eval_requests"] += r.eval
            self._counts["rows"] += len(episodes)
        return result

    def forget(self, group_id: str) -> None:
        """A group's episodes are over (stored, failed or cancelled): no write of it can come any more."""
        with self._write_lock:
            self.running_ids.discard(group_id)
            self._cancelled.discard(group_id)
            self._written.discard(group_id)

    def statistics(self, pending: int = 0, running: int = 0) -> GenerationStatistics:
        return GenerationStatistics(
            version=self.version,
            pending=pending,
            running=running,
            last_batch_s=self._last_batch_s,
            env_failures=self.env_failures,
            **self._counts,
        )


class GenerationActor:
    """Batches concurrent `generate` calls over one `GenerationCore`. Run it as a Ray async actor
    (`ray.remote(GenerationActor)`) or on a local event loop; `storage_factory` is a picklable
    zero-arg callable returning an object with `put_rows_sync`."""

    def __init__(
        self,
        name: str,
        model_cfg: ModelConfig,
        storage_factory: Callable[[], Any],
        reward_fn: str | Callable,
        *,
        reward: RewardConfig | None = None,
        seed: int = 0,
        sampling_seed: int = 0,
        torch_threads: int = 1,
        max_batch_groups: int = 16,
        policy: nn.Module | None = None,
        env: EnvConfig | None = None,
        max_new_tokens: int = 3,
    ):
        redirect_output(name)
        torch.set_num_threads(torch_threads)
        self._turns = turns_from_env("generate")
        if max_batch_groups < 1:
            raise ValueError(f"max_batch_groups must be >= 1, got {max_batch_groups}")
        self.name = name
        self.max_batch_groups = max_batch_groups
        # Weights arrive with the first update_weights (version 0 from the trainer); until then the
        # parameters are placeholders and generate() refuses to run.
        dtype = getattr(torch, model_cfg.dtype)  # weights and compute; snapshots are cast to it on load
        if policy is None and model_cfg.path is not None:  # the same architecture as the trainer's
            policy = load_hf_policy(model_cfg.path, dtype=dtype)
        if policy is None:
            policy = TinyGPT(model_cfg, TOKENIZER.vocab_size, seed=None).to(dtype)
        # The storage client connects on first use (or connect()): storage may still be starting.
        self._core = GenerationCore(
            policy.requires_grad_(False),
            LazyRowStorage(storage_factory),
            reward_fn,
            reward=reward,
            tokenizer=load_tokenizer(model_cfg.path),
            seed=seed,
            name=name,
            sampling_seed=sampling_seed,
        )
        self._pending: collections.deque[tuple[GenerationRequest, asyncio.Future]] = collections.deque()
        self._eval_pending: collections.deque[tuple[GenerationRequest, asyncio.Future]] = collections.deque()  # first
        self._rollout_n = 1
        self._by_group: dict[str, asyncio.Future] = {}  # queued generate_many requests, for cancel()
        self._started: dict[str, float] = {}  # group id -> when its work started (`running`), while under way
        self._running, self._closed, self._early_cancels = 0, False, EarlyCancels()  # (cancels run before arrival)
        # Created by _start() on first use: the event loop is running by then.
        self._has_pending: asyncio.Event
        self._weights_lock: asyncio.Lock
        self._serving: asyncio.Event  # cleared by pause(): no new batch starts
        self._idle: asyncio.Event  # set while no batch is being sampled
        self._loop_task: asyncio.Task | None = None
        self._receiver = WeightReceiver()  # this process's end of its weight-sync group (collective transport)
        self._episodes: EpisodeRunner | None = None  # multi-turn (`env` set)
        self._groups: dict[str, asyncio.Task] = {}  # episode groups under way
        self._woken = False  # woken, waiting for the update that resumes serving
        self._asleep = False  # weights dropped by sleep(1|2): no batch starts until wake() and an update
        if env is not None and env_enabled(env):
            self._play_episodes(env, policy, max_new_tokens)

    def _play_episodes(self, env: EnvConfig, policy: nn.Module, max_new_tokens: int) -> None:
        """Multi-turn: every request is a group of episodes (`backends/common/episodes.py`), not a batch item."""
        self._episodes = episode_runner(env, self._core.tokenizer, default_max_new=max_new_tokens, name=self.name)
        positions = int(policy.max_seq_len)  # type: ignore[arg-type]  # TinyGPT's and HF policies' attribute
        self._batcher = TurnBatcher(positions, self._continue_in_turn, self._pass_gate)

    def _start(self) -> None:
        # Created on first use: the event loop is running by then (Ray builds async actors outside it).
        if self._loop_task is None:
            self._has_pending = asyncio.Event()
            self._weights_lock = asyncio.Lock()
            self._serving = asyncio.Event()
            self._serving.set()
            self._idle = asyncio.Event()
            self._idle.set()
            self._weights_changed = asyncio.Event()  # set (and replaced) by every weight update
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop(), name=f"{self.name}.batch_loop")
            self._loop_task.add_done_callback(self._on_loop_done)

    def _on_loop_done(self, task: asyncio.Task) -> None:
        # The loop only ends by close() or a bug; either way no queued call may wait forever.
        cause = None if task.cancelled() else task.exception()
        self._closed = True
        unserved = list(self._eval_pending) + list(self._pending)
        self._pending.clear()
        self._eval_pending.clear()
        for req, fut in unserved:
            if not fut.done():
                err = GenerationFailed(f"{self.name}: batching loop stopped before serving group {req.group_id}")
                err.__cause__ = cause
                fut.set_exception(err)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._closed:
            raise GenerationFailed(f"{self.name} is closed")
        self._start()
        fut = self._submit(request)
        self._has_pending.set()
        return await fut  # cancelling the call cancels fut; the loop then skips it

    def _submit(self, request: GenerationRequest) -> asyncio.Future:
        """Queue a request for the batching loop, or, with an environment, start its episodes."""
        if self._episodes is not None:
            task = asyncio.get_running_loop().create_task(self._episode_group(request), name=request.group_id)
            self._groups[request.group_id] = task
            task.add_done_callback(lambda _t: self._groups.pop(request.group_id, None))
            return task
        fut = asyncio.get_running_loop().create_future()
        self._lane(request).append((request, fut))
        return fut

    def _lane(self, request: GenerationRequest) -> collections.deque:
        if not request.eval:
            self._rollout_n = request.sampling.n  # rows of a rollout group: what an eval request is weighed against
        return self._eval_pending if request.eval else self._pending

    async def generate_many(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult | GenerationFailed]:
        """Several requests in one call (the client coalesces what the controller sends in one tick);
        each entry is its request's result, or the GenerationFailed that ended it."""
        if self._closed:
            raise GenerationFailed(f"{self.name} is closed")
        self._start()
        futs = []
        for req in requests:
            if self._early_cancels.take(req.group_id):  # its cancel ran first: nothing samples for nobody
                fut = asyncio.get_running_loop().create_future()
                fut.cancel()
            else:
                fut = self._submit(req)
                self._by_group[req.group_id] = fut
            futs.append(fut)
        self._has_pending.set()
        try:
            if futs:
                await asyncio.wait(futs)  # every request's own outcome is read below
        except asyncio.CancelledError:
            for fut in futs:
                fut.cancel()  # the batching loop skips cancelled requests: nothing samples for nobody
            raise
        finally:
            for req in requests:
                self._by_group.pop(req.group_id, None)
        out: list[GenerationResult | GenerationFailed] = []
        for req, fut in zip(requests, futs):
            if fut.cancelled():
                out.append(GenerationFailed(f"{self.name}: group {req.group_id} was cancelled"))
                continue
            exc = fut.exception()
            if isinstance(exc, GenerationFailed):
                out.append(exc)
            elif exc is not None:
                raise exc  # a bug, not a generation failure: let it surface
            else:
                out.append(fut.result())
        return out

    async def cancel(self, group_id: str) -> bool:
        """Cancel a request of `generate_many`: a queued one is dropped; one being sampled is not
        stored. Returns once no row of the group can be written any more; True if its rows were
        already stored (the caller clears them)."""
        written = False
        running = group_id in self._core.running_ids
        if running:  # waits out a write in progress, then blocks any later one
            written = await asyncio.to_thread(self._core.cancel, group_id)
        fut = self._by_group.get(group_id)
        if fut is not None and not fut.done():
            fut.cancel()
        elif fut is None and not running:
            self._early_cancels.add(group_id)  # not arrived yet (or answered already): refused if it comes
        return written

    async def _episode_group(self, request: GenerationRequest) -> GenerationResult:
        """Play a group's episodes and store their rows (`backends/common/episodes.py`)."""
        assert self._episodes is not None
        gid = request.group_id
        while request.min_version is not None and (
            self._core.version is None or self._core.version < request.min_version
        ):
            await self._weights_changed.wait()  # version-gated, as the batching loop holds requests
        self._core.running_ids.add(gid)
        self._started[gid] = time.monotonic()
        try:
            episodes = await self._episodes.run_group(request, self._batcher)
            store = asyncio.ensure_future(asyncio.to_thread(self._core.store_episodes, request, episodes))
            try:
                result = await asyncio.shield(store)
            except asyncio.CancelledError:
                await store  # a write under way ends before the group counts as over
                raise
        except EnvironmentFailed:
            self._core.env_failures += 1
            raise
        finally:
            self._core.forget(gid)
            self._started.pop(gid, None)
        if result is None:
            raise GenerationFailed(f"{self.name}: group {gid} was cancelled")
        return result

    @contextlib.asynccontextmanager
    async def _pass_gate(self) -> AsyncIterator[None]:
        """Around one pass of turns: not while paused; the weights stay put; pause() waits for it."""
        await self._serving.wait()
        async with self._weights_lock:
            self._idle.clear()
            self._running += 1
            try:
                yield
            finally:
                self._running -= 1
                self._idle.set()

    async def update_weights(self, weights: WeightsHandle) -> int:
        """Fetch the snapshot (sampling goes on meanwhile), then apply it between batches; returns the new version."""
        if self._closed:
            raise GenerationFailed(f"{self.name} is closed")
        self._start()
        return await self._apply(weights.version, await resolve_snapshot(weights.payload))

    # The collective transport (`backends.common.weight_broadcast`): this process is rank 1 of its group.

    async def sync_ranks(self) -> int:
        """The processes of this worker that join its weight-sync group."""
        return 1

    async def join_sync_group(self, addr: GroupAddress) -> None:
        await asyncio.to_thread(self._receiver.join, addr, 1)

    async def receive_weights(self, weights: WeightsHandle, key: str) -> int:
        """Receive the broadcast of `weights` (sampling goes on meanwhile), then apply it like `update_weights`."""
        if self._closed:
            raise GenerationFailed(f"{self.name} is closed")
        self._start()
        manifest = weights.payload.manifest
        snapshot = await asyncio.to_thread(self._receiver.receive, key, manifest)
        return await self._apply(weights.version, snapshot)

    async def _apply(self, version: int, snapshot: WeightSnapshot) -> int:
        if snapshot.manifest.version != version:
            raise ValueError(f"handle v{version} carries a snapshot of v{snapshot.manifest.version}")
        async with self._weights_lock:
            if self._asleep:
                raise GenerationFailed(f"{self.name}: update_weights(v{version}) while asleep (wake() first)")
            # Synchronous on the loop: nothing can cancel it halfway.
            self._core.load_weights(snapshot)
        if self._woken:  # a sleep stopped serving: the published weights are in, it serves again
            self._woken = False
            self._serving.set()
        self._weights_changed.set()  # episode groups held for these weights may start now
        self._weights_changed = asyncio.Event()
        if self._pending or self._eval_pending:
            self._has_pending.set()  # requests held for these weights may go now
        loaded = self._core.version
        assert loaded is not None  # load_weights set it
        return loaded

    async def sleep(self, level: int) -> None:
        """Shrunk out of the run (`protocols.Sleepable`): level 1 frees the weights, level 2 the weights
        and caches (this engine keeps no cache between batches: the same); level 0 changes nothing.
        Waits for the batch being sampled; no batch starts until `wake()` and an update. Idempotent."""
        if level not in (0, 1, 2):
            raise ValueError(f"{self.name}: sleep level must be 0, 1 or 2, got {level}")
        self._start()
        if level == 0 or self._asleep:
            return
        self._serving.clear()
        await self._idle.wait()
        async with self._weights_lock:
            self._core.drop_weights()
            self._asleep = True
        gc.collect()  # the parameters' storage goes back now, not at the next collection

    async def wake(self) -> None:
        """Take the weights' memory back (not their values: the next update brings them). Idempotent."""
        self._start()
        if not self._asleep:
            return
        async with self._weights_lock:
            self._core.restore_weights()
            self._asleep = False
        self._woken = True  # the next update resumes serving

    async def policy_version(self) -> int | None:
        return self._core.version

    async def pause(self) -> int:
        """Stop starting batches (requests keep queueing) and return once the batch being sampled,
        if any, has finished: the engine is then idle until `resume()`. Returns the queued count."""
        self._start()
        self._serving.clear()
        await self._idle.wait()
        return await self.in_flight()

    async def resume(self) -> None:
        self._start()
        self._serving.set()

    async def connect(self) -> None:
        """Connect the storage client now rather than on the first batch."""
        await asyncio.to_thread(self._core.storage.connect)

    async def in_flight(self) -> int:
        queued = itertools.chain(self._eval_pending, self._pending)
        return sum(1 for _, f in queued if not f.done()) + self._running + len(self._groups)

    async def running(self) -> dict[str, float]:
        """`protocols.ReportsRunning` (the rollout pump's liveness call): the groups being sampled or
        played, with how long each has run; queued and version-held ones are absent. Answered on the
        actor's loop while a batch samples in its thread."""
        now = time.monotonic()
        return {gid: now - t for gid, t in self._started.items()}

    async def version(self) -> int | None:
        return self._core.version

    async def statistics(self) -> GenerationStatistics:
        return self._core.statistics(pending=await self.in_flight() - self._running, running=self._running)

    async def get_weights(self) -> dict[str, Any]:
        """Copies of the parameters as numpy arrays (for checks; bfloat16 ones upcast exactly to float32)."""
        return {
            n: (p.detach().float() if p.dtype == torch.bfloat16 else p.detach().clone()).numpy()
            for n, p in state_module(self._core.policy).named_parameters()
        }

    async def close(self) -> None:
        """Stop the batching loop and fail every queued request."""
        self._closed = True
        for task in list(self._groups.values()):
            task.cancel()
        if self._episodes is not None:
            await self._batcher.close()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait([self._loop_task])  # its CancelledError stays with it; _on_loop_done fails the queue
        self._core.scorer.close()

    async def _batch_loop(self) -> None:
        while True:
            # Exits: cancelled by close(). A failing batch fails its own requests, not the loop.
            await self._has_pending.wait()
            await self._serving.wait()
            batch = self._take_batch()
            if batch:
                await self._serve(batch)

    def _take_batch(self) -> list[tuple[GenerationRequest, asyncio.Future]]:
        """The eval lane first, then rollouts, up to `max_batch_groups` groups; an eval request counts
        as its share of a rollout group by rows (n / the last rollout's n), so a whole eval round of
        one-sample requests usually fits in one batch (one weight version, little delay to rollouts).
        A request that needs newer weights than those loaded (`min_version`) stays in its lane, in
        its place, while those behind it that need none go."""
        batch: list[tuple[GenerationRequest, asyncio.Future]] = []
        budget = float(self.max_batch_groups)
        version = self._core.version
        for lane in (self._eval_pending, self._pending):  # the eval lane first
            held = []
            while lane:
                req, fut = lane[0]
                if fut.done():  # skip calls cancelled while queued
                    lane.popleft()
                    continue
                if req.min_version is not None and (version is None or req.min_version > version):
                    held.append(lane.popleft())  # until an update brings its weights
                    continue
                cost = req.sampling.n / self._rollout_n if req.eval else 1.0
                if batch and cost > budget:
                    break
                lane.popleft()
                batch.append((req, fut))
                budget -= cost
            lane.extendleft(reversed(held))  # back in front, in their order
        if not batch:  # empty lanes, or only held requests: wait for a request or for weights
            self._has_pending.clear()
        return batch

    def _continue_in_turn(self, asks: list) -> list[Continuation]:
        with self._turns.hold():  # `backend.colocate`: the node's cores are this worker's for the pass
            return self._core.continue_pass(asks)

    def _generate_in_turn(self, requests: list[GenerationRequest]) -> list[GenerationResult | RewardFailed | None]:
        with self._turns.hold():  # `backend.colocate`: the node's cores are this worker's for the batch
            return self._core.generate(requests)

    async def _serve(self, batch: list[tuple[GenerationRequest, asyncio.Future]]) -> None:
        self._running = len(batch)
        self._idle.clear()
        self._core.running_ids = {r.group_id for r, _ in batch}  # on the loop: before any cancel can look
        t0 = time.monotonic()
        self._started.update((r.group_id, t0) for r, _ in batch)
        try:
            async with self._weights_lock:
                results = await asyncio.to_thread(self._generate_in_turn, [r for r, _ in batch])
        except Exception as e:  # delivered to every caller of the batch
            for req, fut in batch:
                if not fut.done():
                    err = GenerationFailed(f"{self.name}: generating group {req.group_id} failed: {e!r}")
                    err.__cause__ = e
                    fut.set_exception(err)
        else:
            for (req, fut), res in zip(batch, results):
                if not fut.done():
                    if res is None:
                        fut.set_exception(GenerationFailed(f"{self.name}: group {req.group_id} was cancelled"))
                    elif isinstance(res, RewardFailed):
                        fut.set_exception(res)  # its group alone
                    else:
                        fut.set_result(res)
        finally:
            self._core.end_batch()
            for req, _ in batch:
                self._started.pop(req.group_id, None)
            self._running = 0
            self._idle.set()
            for req, fut in batch:  # only when cancelled by close(): nothing else would answer them
                if not fut.done():
                    fut.set_exception(GenerationFailed(f"{self.name} closed while sampling group {req.group_id}"))
