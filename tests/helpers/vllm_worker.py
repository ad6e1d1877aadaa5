"""Pieces of the vLLM worker tests (tests/integration/test_vllm_worker.py, test_vllm_episodes.py): rows whose puts a
test holds at a gate, a coroutine run on the module's loop, requests over the digit task, a cancel while the rows
are put. Not a test module."""

from __future__ import annotations

import asyncio
import threading

from replay.storage import InMemoryRowStorage, row_keys
from single_controller.data.tasks import reverse_digits
from single_controller.types import GenerationRequest, SamplingParams


class GatedStorage(InMemoryRowStorage):
    """In-memory rows whose puts can be held at a gate (from the engine's writer thread)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.put_started = threading.Event()
        self._mutex = threading.Lock()

    def put_rows_sync(self, keys, columns, tags=None):
        self.put_started.set()
        self.gate.wait(30)
        with self._mutex:
            super().put_rows_sync(keys, columns, tags)

    def clear_rows_sync(self, keys):
        with self._mutex:
            super().clear_rows_sync(keys)

    def keys_of(self, group_id: str) -> list[str]:
        with self._mutex:
            return [k for k in self._rows if k.startswith(f"{group_id}_g")]


def run(loop, coro, timeout=120):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def digit_requests(
    prefix: str, n_groups: int, G: int = 4, max_new_tokens: int = 3, seed: int = 0
) -> list[GenerationRequest]:
    prompts = reverse_digits(n_groups, 3, seed=seed)
    return [
        GenerationRequest(
            f"{prefix}{i}", p, SamplingParams(n=G, max_new_tokens=max_new_tokens), row_keys(f"{prefix}{i}", G)
        )
        for i, p in enumerate(prompts)
    ]


def cancel_while_put(actor, storage, loop, req):
    """Cancel `req` while its rows are being put: the cancel waits for the put in flight and answers
    True (its rows were written, and are taken back). Returns the request's own outcome."""
    storage.gate.clear()
    storage.put_started.clear()
    task = loop.create_task(actor.generate_many([req]))

    async def cancel_while_writing():
        while not storage.put_started.is_set():
            await asyncio.sleep(0.005)  # test code: the writer thread signals through a threading.Event
        cancel = asyncio.ensure_future(actor.cancel(req.group_id))
        await asyncio.sleep(0.05)
        assert not cancel.done()  # waits for the put in flight
        storage.gate.set()
        return await cancel

    try:
        assert run(loop, cancel_while_writing()) is True
    finally:
        storage.gate.set()
    (res,) = run(loop, task)
    return res
