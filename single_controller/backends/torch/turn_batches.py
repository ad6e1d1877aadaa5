"""Multi-turn generation on the torch worker: the `TurnEngine` of `backends/common/episodes.py`.

`TurnBatcher` gathers the turns asked for at one moment into one `sampling.sample` pass per distinct
(length, budget, settings), under the worker's weights lock: a pass sees one policy version, and an
episode spanning an update carries both, token by token. The torch sampler keeps no cache between
turns, so each turn prefills the whole sequence.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from single_controller.backends.common.episodes import Continuation
from single_controller.backends.torch.sampling import sample
from single_controller.types import GenerationRequest


@dataclass
class _Ask:
    ids: list[int]
    max_new: int
    request: GenerationRequest
    stop_ids: tuple[int, ...]
    future: asyncio.Future


class TurnBatcher:
    """Batches concurrent `continue_sequence` calls of one worker into sampling passes.

    `run_pass(asks) -> list[Continuation]` runs in a thread; `gate` is an async context manager
    factory held around it (the worker's weights lock and its pause/idle bookkeeping)."""

    def __init__(self, max_seq_len: int, run_pass: Callable[[list[_Ask]], list[Continuation]], gate: Callable[[], Any]):
        self.max_seq_len = max_seq_len
        self._run_pass = run_pass
        self._gate = gate
        self._asks: list[_Ask] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def continue_sequence(
        self, ids: Sequence[int], max_new: int, request: GenerationRequest, stop_ids: tuple[int, ...]
    ) -> Continuation:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="turn_batcher")
        fut = asyncio.get_running_loop().create_future()
        self._asks.append(_Ask(list(ids), max_new, request, stop_ids, fut))
        self._wake.set()
        return await fut  # cancelling the episode cancels fut; the next pass skips it

    def pending(self) -> int:
        return sum(not a.future.done() for a in self._asks)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
        for a in self._asks:
            if not a.future.done():
                a.future.cancel()

    async def _loop(self) -> None:
        while True:
            # Exits: cancelled by close().
            await self._wake.wait()
            for _ in range(3):  # let the episodes that are just back from their environment ask too
                await asyncio.sleep(0)
            async with self._gate():
                asks = [a for a in self._asks if not a.future.done()]
                self._asks, batch = [], asks
                self._wake.clear()
                if not batch:
                    continue
                try:
                    outs = await asyncio.to_thread(self._run_pass, batch)
                except Exception as e:  # every episode of the pass sees the engine's error
                    for a in batch:
                        if not a.future.done():
                            a.future.set_exception(e)
                    continue
            for a, out in zip(batch, outs):
                if not a.future.done():
                    a.future.set_result(out)


def sample_continuations(
    policy: Any, asks: Sequence[_Ask], version: int, *, pad_id: int, generator
) -> list[Continuation]:
    """One `sample` pass per distinct (length, budget, settings) of `asks`; the continuations in order."""
    passes: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, a in enumerate(asks):
        s = a.request.sampling
        passes[(len(a.ids), a.max_new, s.temperature, s.top_p, a.stop_ids)].append(i)
    out: list[Continuation | None] = [None] * len(asks)
    for (_, max_new, temperature, top_p, stop), idx in passes.items():
        greedy = temperature == 0
        got = sample(
            policy,
            torch.tensor([asks[i].ids for i in idx], dtype=torch.long),
            max_new_tokens=max_new,
            temperature=1.0 if greedy else temperature,
            top_p=top_p,
            stop_token_ids=stop,
            pad_id=pad_id,
            generator=generator,
            greedy=greedy,
        )
        tokens, logprobs, lengths = got.tokens.tolist(), got.logprobs.tolist(), got.lengths.tolist()
        for row, i in enumerate(idx):
            n = lengths[row]
            out[i] = Continuation(tuple(tokens[row][:n]), tuple(logprobs[row][:n]), (version,) * n)
    return [c for c in out if c is not None]
