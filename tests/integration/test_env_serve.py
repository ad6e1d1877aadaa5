"""`sc-grpo env serve` in its own process, killed mid-episode: the next call fails at once naming the call and the
url, not at its deadline. The other failure modes over HTTP, in this process: tests/unit/test_env_http.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from single_controller.envs.contract import Action, EnvFailed, EpisodeItem
from single_controller.envs.http_client import HttpEnvironment, check_env_url

ROOT = Path(__file__).resolve().parents[2]
ITEM = EpisodeItem("p00004", "^3>", "482", index=2)
GUARD_S = 10.0  # far past every deadline below: reaching it means the deadline did not hold


@pytest.fixture
def served_lookup():
    """`sc-grpo env serve lookup --port 0` in its own process; yields (process, the url it printed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "single_controller.runtime.cli", "env", "serve", "lookup", "--port", "0"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) as proc:
        try:
            url = proc.stdout.readline().strip()
            assert url.startswith("http://127.0.0.1:"), (url, proc.stderr.read() if proc.poll() is not None else "")
            yield proc, url
        finally:
            proc.kill()
            proc.wait(timeout=10)


async def test_a_server_killed_mid_episode_fails_the_next_call_quickly_naming_it(served_lookup):
    proc, url = served_lookup
    check_env_url(url, 5.0)  # the CLI's server speaks the protocol
    env = HttpEnvironment(url, timeout_s=GUARD_S / 2)
    assert await env.reset(ITEM) == ""
    assert (await env.step(Action("?3"))).done  # no tool call given: a final answer, the server works
    env = HttpEnvironment(url, timeout_s=GUARD_S / 2)
    await env.reset(ITEM)
    proc.kill()
    proc.wait(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(EnvFailed) as info:
        await asyncio.wait_for(env.step(Action("482")), GUARD_S)
    assert time.monotonic() - t0 < 2.0  # refused at once, not at the deadline
    e = info.value
    assert e.what == "step" and e.episode == env.episode and e.episode.startswith("p00004.2.a0.")
    assert f"POST {url}/step" in str(e) and "ConnectionRefusedError" in str(e)
