"""Fixtures shared by the integration tests."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def loop():
    """One long-lived event loop per test module, like the controller's (TransferQueue pools its sockets per loop;
    an engine's or a Ray client's tasks stay on it); tests run coroutines on it with `loop.run_until_complete`."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
