"""Environments over HTTP when things go wrong, in this process: a server that hangs, one that answers garbage or
errors, idle episodes, the checks before start-up, loopback by default, the CLI (a server process killed
mid-episode: tests/integration/test_env_serve.py).

Each wait is bounded by `asyncio.wait_for` well past the deadline under test, so a missing deadline
fails the test instead of hanging it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from single_controller.config.schema import EnvConfig
from single_controller.envs import http_server
from single_controller.envs.builtin import LookupEnv
from single_controller.envs.contract import Action, EnvContractError, EnvFailed, EpisodeItem, StepOutcome
from single_controller.envs.http_client import EnvUnreachable, HttpEnvironment, check_env_url
from single_controller.envs.http_server import EnvServer
from single_controller.envs.inprocess import check_env
from single_controller.runtime import cli

ITEM = EpisodeItem("p00004", "^3>", "482", index=2)
GUARD_S = 10.0  # far past every deadline below: reaching it means the deadline did not hold


@contextlib.contextmanager
def silent_listener():
    """A TCP port that accepts connections (the kernel's backlog) and never answers a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def closed_port_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


class _HangingStep:
    """Answers reset, then never answers a step (a wedged environment behind a live server)."""

    async def reset(self, item):
        return ""

    async def step(self, action):
        await asyncio.Event().wait()


class _Failing:
    async def reset(self, item):
        return ""

    async def step(self, action):
        raise ValueError("boom: the game crashed")


class _Closing(LookupEnv):
    closed: asyncio.Event

    async def close(self):
        _Closing.closed.set()


# -- a server that hangs -----------------------------------------------------------------------------
async def test_a_server_that_accepts_and_never_answers_fails_the_call_at_its_deadline():
    with silent_listener() as url:
        env = HttpEnvironment(url, timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(EnvFailed) as info:
            await asyncio.wait_for(env.reset(ITEM), GUARD_S)
        elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 2.0, elapsed
    assert info.value.what == "reset" and f"POST {url}/reset: no answer within env.timeout_s=0.3 s" in str(info.value)


async def test_a_wedged_environment_behind_a_live_server_fails_the_step_at_its_deadline():
    server = EnvServer(_HangingStep)
    url = await server.start()
    env = HttpEnvironment(url, timeout_s=0.3)
    await env.reset(ITEM)
    t0 = time.monotonic()
    with pytest.raises(EnvFailed) as info:
        await asyncio.wait_for(env.step(Action("1")), GUARD_S)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert info.value.what == "step" and f"POST {url}/step: no answer" in str(info.value)
    await asyncio.wait_for(env.close(), GUARD_S)  # the server still answers other calls
    await asyncio.wait_for(server.stop(), GUARD_S)  # and stops without waiting on the wedged step


async def test_check_env_url_on_a_silent_server_fails_at_its_deadline_naming_the_url():
    with silent_listener() as url:  # closing it at the end also frees a check that would still wait
        t0 = time.monotonic()
        expected = f"env.url {url}: GET /health had no answer within env.timeout_s=0.3 s"
        with pytest.raises(EnvUnreachable, match=expected):
            await asyncio.wait_for(asyncio.to_thread(check_env, EnvConfig(url=url, timeout_s=0.3)), GUARD_S)
        assert time.monotonic() - t0 < 2.0


# -- answers that are not the protocol ---------------------------------------------------------------
async def _raw_server(answer: bytes):
    async def handle(reader, writer):
        await reader.readline()
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize(
    "answer, words",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!", "body that is not JSON"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]", "the answer is not a JSON object"),
        (b'HTTP/1.1 503 Busy\r\nContent-Length: 17\r\n\r\n{"error": "full"}', "HTTP 503: 'full'"),
        (b"SSH-2.0-OpenSSH\r\n", "not an HTTP status line"),
        (b"", "closed without an answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{}", "IncompleteReadError"),
    ],
)
async def test_an_answer_outside_the_protocol_is_an_env_failure_naming_the_url(answer, words):
    server, url = await _raw_server(answer)
    async with server:
        with pytest.raises(EnvFailed, match="environment reset for episode p00004") as info:
            await asyncio.wait_for(HttpEnvironment(url, timeout_s=2.0).reset(ITEM), GUARD_S)
    assert url in str(info.value) and words in str(info.value)


async def test_an_environment_that_raises_is_an_http_500_and_an_env_failure_with_its_message():
    async with EnvServer(_Failing) as server:
        env = HttpEnvironment(server.url, timeout_s=2.0)
        await env.reset(ITEM)
        with pytest.raises(EnvFailed, match="HTTP 500.*step of episode p00004.*ValueError: boom: the game crashed"):
            await env.step(Action("1"))
        assert server.statistics().errors == 1


async def test_a_step_answer_without_a_reward_when_done_is_refused():
    body = b'{"observation": "", "reward": null, "done": true, "info": {}}'
    server, url = await _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    async with server:
        env = HttpEnvironment(url, timeout_s=2.0)
        env.episode = "p00004.0.a0.x"
        with pytest.raises(EnvFailed, match="a final StepOutcome \\(done=True\\) needs a reward"):
            await env.step(Action("1"))


async def test_server_refuses_requests_outside_the_protocol():
    async with EnvServer(LookupEnv) as server:
        env = HttpEnvironment(server.url, timeout_s=2.0)
        env.episode = "never-reset"
        with pytest.raises(EnvFailed, match="HTTP 404.*unknown episode never-reset"):
            await env.step(Action("1"))
        assert (await asyncio.wait_for(env.close(), GUARD_S)) is None  # closing an unknown episode is fine
        with pytest.raises(EnvFailed, match="HTTP 400.*rejects args"):
            await HttpEnvironment(server.url, timeout_s=2.0, args={"nope": 1}).reset(ITEM)
        with pytest.raises(EnvFailed, match="HTTP 400.*item must be a JSON object with a string prompt_id"):
            await env._call("reset", {"episode": "e1", "item": {"prompt": "^3>"}, "args": {}})
        with pytest.raises(EnvFailed, match="HTTP 400.*non-empty string `episode`"):
            await env._call("step", {"action": {"text": "1"}})


async def test_a_reset_of_a_live_episode_id_is_a_conflict():
    async with EnvServer(LookupEnv) as server:
        first = HttpEnvironment(server.url, timeout_s=2.0)
        await first.reset(ITEM)
        payload = {"episode": first.episode, "item": {"prompt_id": "p1", "prompt": "^3>", "answer": "482"}, "args": {}}
        with pytest.raises(EnvFailed, match="HTTP 409.*open already"):
            await first._call("reset", payload)


class _SlowReset:
    """Its reset waits for `release`; every environment made and closed is counted."""

    made: list
    closed: list
    reset_started: asyncio.Event
    release: asyncio.Event
    all_closed: asyncio.Event

    @classmethod
    def begin(cls) -> None:
        cls.made, cls.closed = [], []
        cls.reset_started, cls.release, cls.all_closed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def __init__(self):
        _SlowReset.made.append(self)

    async def reset(self, item):
        _SlowReset.reset_started.set()
        await _SlowReset.release.wait()
        return ""

    async def step(self, action):
        return StepOutcome(reward=1.0, done=True)

    async def close(self):
        _SlowReset.closed.append(self)
        if len(_SlowReset.closed) == len(_SlowReset.made):
            _SlowReset.all_closed.set()


async def test_a_close_while_its_reset_runs_closes_the_environment_as_the_reset_ends():
    """#48 S7: a client's reset misses its deadline and its runner closes the episode while the
    server still resets it: the environment is closed as that reset ends (it stayed open until the
    idle expiry, 600 s by default), and its id is not left open."""
    _SlowReset.begin()
    async with EnvServer(_SlowReset) as server:
        client = HttpEnvironment(server.url, timeout_s=0.3)
        with pytest.raises(EnvFailed, match="no answer within env.timeout_s=0.3"):
            await client.reset(ITEM)
        await asyncio.wait_for(client.close(), GUARD_S)
        _SlowReset.release.set()
        await asyncio.wait_for(_SlowReset.all_closed.wait(), 5.0)
        assert len(_SlowReset.made) == 1 and server.statistics().episodes == 0
        with pytest.raises(EnvFailed, match="HTTP 404.*unknown episode"):
            await client.step(Action("1"))


async def test_a_second_reset_while_the_first_runs_is_a_conflict_and_replaces_nothing():
    """#48 S7: two resets of one episode id at once: the second is refused (409) at once instead of
    making a second environment that replaced the first (never closed, the first's idle timer later
    expiring the second's episode)."""
    _SlowReset.begin()
    async with EnvServer(_SlowReset) as server:
        first = HttpEnvironment(server.url, timeout_s=GUARD_S)
        resetting = asyncio.create_task(first.reset(ITEM))
        await asyncio.wait_for(_SlowReset.reset_started.wait(), GUARD_S)
        again = HttpEnvironment(server.url, timeout_s=1.0)
        payload = {"episode": first.episode, "item": {"prompt_id": "p1", "prompt": "^3>", "answer": "482"}, "args": {}}
        with pytest.raises(EnvFailed, match="HTTP 409.*open already"):
            await again._call("reset", payload)
        _SlowReset.release.set()
        assert await asyncio.wait_for(resetting, GUARD_S) == ""
        assert len(_SlowReset.made) == 1 and server.statistics().episodes == 1
        await first.close()
        assert _SlowReset.all_closed.is_set() and server.statistics().episodes == 0


# -- idle episodes ---------------------------------------------------------------------------------
async def test_an_idle_episode_expires_and_its_environment_is_closed():
    _Closing.closed = asyncio.Event()
    async with EnvServer(_Closing, idle_timeout_s=0.2) as server:
        env = HttpEnvironment(server.url, timeout_s=2.0)
        await env.reset(ITEM)
        assert server.statistics().episodes == 1
        await asyncio.wait_for(_Closing.closed.wait(), GUARD_S)
        assert server.statistics().episodes == 0 and server.statistics().expired == 1
        with pytest.raises(EnvFailed, match="HTTP 404.*expired after 0.2 s without a request"):
            await env.step(Action("482"))


async def test_stop_closes_the_open_episodes():
    _Closing.closed = asyncio.Event()
    server = EnvServer(_Closing)
    await server.start()
    await HttpEnvironment(server.url, timeout_s=2.0).reset(ITEM)
    await server.stop()
    assert _Closing.closed.is_set()


# -- before start-up -------------------------------------------------------------------------------
def test_check_env_url_names_an_unreachable_url_and_a_server_of_another_protocol():
    url = closed_port_url()
    with pytest.raises(EnvUnreachable, match=f"env.url {url}: GET /health failed: ConnectionRefusedError"):
        check_env(EnvConfig(url=url, timeout_s=2.0))
    with pytest.raises(EnvContractError, match="is not an http:// or https:// URL"):
        check_env(EnvConfig(url="ftp://127.0.0.1:1", timeout_s=2.0))


async def test_check_env_url_refuses_a_server_that_is_not_an_environment():
    body = b'{"protocol": "something-else"}'
    server, url = await _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    async with server:
        with pytest.raises(EnvContractError, match=f"env.url {url}: GET /health answered HTTP 200.*sc-grpo-env/1"):
            await asyncio.to_thread(check_env_url, url, 2.0)


async def test_an_unreachable_server_fails_a_call_quickly():
    url = closed_port_url()
    with pytest.raises(EnvFailed, match=f"environment reset .* POST {url}/reset: ConnectionRefusedError"):
        await asyncio.wait_for(HttpEnvironment(url, timeout_s=GUARD_S / 2).reset(ITEM), 2.0)


# -- loopback by default, the CLI ------------------------------------------------------------------
async def test_the_server_binds_loopback_by_default():
    async with EnvServer(LookupEnv) as server:
        assert server.address[0] == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
    args = http_server._parser().parse_args(["serve", "lookup"])
    assert (args.host, args.port) == ("127.0.0.1", 8765)


def test_env_serve_refuses_a_bad_spec_or_args_before_listening(capsys):
    assert cli.main(["env", "serve", "no_such_env_module_xyz:Env"]) == 2
    assert "sc-grpo env serve: env.fn 'no_such_env_module_xyz:Env': cannot import" in capsys.readouterr().err
    assert cli.main(["env", "serve", "guess", "--args", "[1]"]) == 2
    assert "--args '[1]': not a JSON object" in capsys.readouterr().err
    assert cli.main(["env", "serve", "guess", "--args", '{"shaped": true, "x": 1}']) == 2
    assert "rejects env.args" in capsys.readouterr().err


async def test_request_args_override_the_served_args():
    async with EnvServer(lambda **kw: StepRecorder(**{"tag": "served", **kw})) as server:
        env = HttpEnvironment(server.url, timeout_s=2.0, args={"tag": "run"})
        await env.reset(ITEM)
        assert (await env.step(Action("x"))).info == {"tag": "run"}


class StepRecorder:
    def __init__(self, tag: str):
        self.tag = tag

    async def reset(self, item):
        return ""

    async def step(self, action):
        return StepOutcome(reward=0.0, done=True, info={"tag": self.tag})
