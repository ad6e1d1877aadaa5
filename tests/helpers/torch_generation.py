"""Pieces of the torch generation tests that the eval tests use too: a group's request over the task's
prompts, and a core whose batches a test releases. Not a test module."""

from __future__ import annotations

import threading

from replay.storage import row_keys
from single_controller.data.tasks import reverse_digits
from single_controller.types import GenerationRequest, SamplingParams

PROMPTS = reverse_digits(20, 3, seed=0)


def request(i: int, n: int = 4, prompt=None, **sampling) -> GenerationRequest:
    gid = f"grp{i}"
    return GenerationRequest(gid, prompt or PROMPTS[i], SamplingParams(n=n, **sampling), row_keys(gid, n))


class GatedCore:
    """Wraps a core's generate so a test decides when a batch may finish."""

    def __init__(self, core):
        self.core, self.inner = core, core.generate
        self.started, self.release = threading.Event(), threading.Event()
        self.batches: list[list[str]] = []
        core.generate = self.generate

    def generate(self, requests):
        self.batches.append([r.group_id for r in requests])
        self.started.set()
        assert self.release.wait(10), "test never released the batch"
        return self.inner(requests)
