"""Serve any in-process environment class over the JSON protocol of docs/environments.md.

`EnvServer(factory, host, port)` (loopback by default) makes a fresh environment per `/reset`, kept
under its episode id until `/close` or `idle_timeout_s` of silence, so a crashed client leaks
nothing. A second reset of a live episode is a 409; a close during its reset closes it as soon as
the reset ends. Errors answer 400 / 404 / 409 / 500 with `{"error": ...}`. `main(argv)` is
`sc-grpo env serve SPEC [--host] [--port] [--args JSON] [--idle-timeout S]`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from single_controller.envs.contract import Action, EnvContractError, EpisodeItem, StepOutcome, ToolCall
from single_controller.envs.http_client import MAX_BODY_BYTES, PROTOCOL, HttpProtocolError, read_headers

log = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT_S = 600.0
REQUEST_READ_TIMEOUT_S = 30.0  # a client that connects and sends nothing holds no handler longer
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 409: "Conflict", 500: "Internal Server Error"}


class _HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class EnvServerStatistics:
    episodes: int  # open now
    requests: int
    errors: int  # answers of status >= 400
    expired: int  # episodes closed for being idle


@dataclass
class _Episode:
    env: Any
    timer: asyncio.TimerHandle | None


class EnvServer:
    """See the module's contract."""

    def __init__(
        self,
        factory: Callable[..., Any],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ):
        self.factory, self.host, self.port, self.idle_timeout_s = factory, host, port, idle_timeout_s
        self._server: asyncio.Server | None = None
        self._episodes: dict[str, _Episode] = {}
        self._resetting: dict[str, bool] = {}  # episodes whose reset is under way -> closed meanwhile
        self._handlers: set[asyncio.Task] = set()
        self._closing: set[asyncio.Task] = set()  # closes of expired episodes
        self._requests = self._errors = self._expired = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        return self.url

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the listener is bound to."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the environment server is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()  # requests in progress (a wedged environment's among them) end here
        if handlers:
            await asyncio.wait(handlers)
        if server is not None:
            await server.wait_closed()
        episodes, self._episodes = list(self._episodes.values()), {}
        for ep in episodes:
            if ep.timer is not None:
                ep.timer.cancel()
            await self._close_quietly(ep.env)
        for task in list(self._closing):
            await task

    async def __aenter__(self) -> EnvServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def statistics(self) -> EnvServerStatistics:
        return EnvServerStatistics(len(self._episodes), self._requests, self._errors, self._expired)

    # -- one connection, one request
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._requests += 1
        try:
            status, answer = await self._answer(reader)
            if status >= 400:
                self._errors += 1
            data = json.dumps(answer).encode()
            reason = _REASONS.get(status, "")
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                f"Connection: close\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        except OSError:
            pass  # the client went away (its own deadline): nothing to answer
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, Any]:
        try:
            async with asyncio.timeout(REQUEST_READ_TIMEOUT_S):
                method, path, body = await _read_request(reader)
            return 200, await self._dispatch(method, path, body)
        except _HttpError as e:
            return e.status, {"error": str(e)}
        except (TimeoutError, HttpProtocolError, asyncio.IncompleteReadError, ValueError) as e:
            return 400, {"error": f"not a request of the protocol: {type(e).__name__}: {e}"}

    async def _dispatch(self, method: str, path: str, body: bytes) -> Any:
        if method == "GET" and path == "/health":
            return {"protocol": PROTOCOL, "episodes": len(self._episodes)}
        calls = {"/reset": self._reset, "/step": self._step, "/close": self._close}
        if method != "POST" or path not in calls:
            raise _HttpError(404, f"no {method} {path}: the protocol has GET /health, POST /reset, /step, /close")
        request = json.loads(body) if body else None
        if not isinstance(request, dict) or not isinstance(request.get("episode"), str) or not request["episode"]:
            raise _HttpError(400, f"POST {path} needs a JSON object with a non-empty string `episode`")
        return await calls[path](request["episode"], request)

    # -- the protocol's calls
    async def _reset(self, episode: str, request: dict[str, Any]) -> Any:
        if episode in self._episodes or episode in self._resetting:
            raise _HttpError(409, f"episode {episode} is open already (one reset per episode id)")
        item, args = item_from_json(request.get("item")), request.get("args") or {}
        if not isinstance(args, dict):
            raise _HttpError(400, f"args must be a JSON object, got {args!r:.100}")
        try:
            env = self.factory(**args)
        except TypeError as e:
            raise _HttpError(400, f"the environment rejects args {args!r:.200}: {e}") from None
        self._resetting[episode] = False  # the id is taken from here on
        try:
            observation = await env.reset(item)
        except BaseException as e:  # its error, or the server stops (cancelled): nobody else closes it
            await self._close_quietly(env)
            if isinstance(e, Exception):
                raise _env_error("reset", episode, e) from None
            raise
        finally:
            closed = self._resetting.pop(episode)
        if closed:
            await self._close_quietly(env)
            raise _HttpError(404, f"episode {episode} was closed while it was being reset")
        if not isinstance(observation, str):
            await self._close_quietly(env)
            raise _HttpError(500, f"reset of episode {episode} returned a {type(observation).__name__}, not a str")
        self._episodes[episode] = _Episode(env, self._arm(episode))
        return {"observation": observation}

    async def _step(self, episode: str, request: dict[str, Any]) -> Any:
        ep = self._open(episode)
        action = action_from_json(request.get("action"))
        if ep.timer is not None:
            ep.timer.cancel()  # not idle while it steps
            ep.timer = None
        try:
            out = await ep.env.step(action)
        except Exception as e:
            raise _env_error("step", episode, e) from None
        finally:
            if self._episodes.get(episode) is ep:
                ep.timer = self._arm(episode)
        if not isinstance(out, StepOutcome):
            raise _HttpError(500, f"step of episode {episode} returned a {type(out).__name__}, not a StepOutcome")
        answer = {"observation": out.observation, "reward": out.reward, "done": out.done, "info": dict(out.info)}
        try:
            json.dumps(answer)
        except (TypeError, ValueError) as e:
            raise _HttpError(500, f"step of episode {episode}: its info is not JSON ({e})") from None
        return answer

    async def _close(self, episode: str, request: dict[str, Any]) -> Any:
        if episode in self._resetting:  # its reset closes the environment when it ends
            self._resetting[episode] = True
            return {"closed": True}
        ep = self._episodes.pop(episode, None)
        if ep is None:
            return {"closed": False}  # closed, expired or never reset: nothing left to close
        if ep.timer is not None:
            ep.timer.cancel()
        close = getattr(ep.env, "close", None)
        if close is not None:
            try:
                await close()
            except Exception as e:
                raise _env_error("close", episode, e) from None
        return {"closed": True}

    def _open(self, episode: str) -> _Episode:
        ep = self._episodes.get(episode)
        if ep is None:
            raise _HttpError(
                404,
                f"unknown episode {episode}: never reset, closed, or expired after "
                f"{self.idle_timeout_s:g} s without a request",
            )
        return ep

    # -- idle expiry
    def _arm(self, episode: str) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(self.idle_timeout_s, self._expire, episode)

    def _expire(self, episode: str) -> None:
        ep = self._episodes.pop(episode, None)
        if ep is None:
            return
        self._expired += 1
        log.warning("environment episode %s expired after %g s without a request", episode, self.idle_timeout_s)
        task = asyncio.ensure_future(self._close_quietly(ep.env))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_quietly(self, env: Any) -> None:
        """Close an environment nobody waits on (expired, failed reset, server stop); errors are logged."""
        close = getattr(env, "close", None)
        if close is None:
            return
        try:
            async with asyncio.timeout(REQUEST_READ_TIMEOUT_S):
                await close()
        except Exception:
            log.exception("closing environment %r failed", env)


def _env_error(what: str, episode: str, e: Exception) -> _HttpError:
    log.warning("environment %s of episode %s raised %s: %s", what, episode, type(e).__name__, e)
    return _HttpError(500, f"the environment's {what} of episode {episode} raised {type(e).__name__}: {e}")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    line = await reader.readline()
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise HttpProtocolError(f"not an HTTP request line: {line[:200]!r}")
    headers = await read_headers(reader)
    size = int(headers.get("content-length", "0"))
    if size > MAX_BODY_BYTES:
        raise HttpProtocolError(f"a request of {size} bytes (at most {MAX_BODY_BYTES})")
    return parts[0], parts[1].split("?", 1)[0], await reader.readexactly(size)


def item_from_json(obj: Any) -> EpisodeItem:
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt_id"), str):
        raise _HttpError(400, f"item must be a JSON object with a string prompt_id, got {obj!r:.200}")
    columns, answer = obj.get("columns") or {}, obj.get("answer", "")
    attempt, index = obj.get("attempt", 0), obj.get("index", 0)
    if (
        not isinstance(columns, dict)
        or not isinstance(answer, str)
        or not all(isinstance(n, int) for n in (attempt, index))
    ):
        raise _HttpError(
            400, f"item: columns must be an object, answer a string, attempt and index integers: {obj!r:.200}"
        )
    return EpisodeItem(obj["prompt_id"], obj.get("prompt"), answer, columns, attempt, index)


def action_from_json(obj: Any) -> Action:
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise _HttpError(400, f"action must be a JSON object with a string text, got {obj!r:.200}")
    call = obj.get("tool_call")
    if call is None:
        return Action(obj["text"])
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise _HttpError(400, f"action.tool_call must be null or an object with a string name, got {call!r:.200}")
    error = call.get("error")
    return Action(obj["text"], ToolCall(call["name"], call.get("arguments"), None if error is None else str(error)))


# -- sc-grpo env serve
def _with_args(cls: Any, serve_args: Mapping[str, Any], /, **request_args: Any) -> Any:
    return cls(**{**serve_args, **request_args})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sc-grpo env", description="Environments over HTTP (docs/environments.md).")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser(
        "serve",
        help="serve an environment class",
        description="Serve SPEC (`lookup`, `guess` or module:Class, as env.fn takes it) over the JSON protocol; "
        "prints the url it listens on; Ctrl-C or SIGTERM stops it. Runs use it with env.url=URL.",
        epilog="example:\n  sc-grpo env serve lookup --port 8765",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("spec", metavar="SPEC", help="lookup, guess, or module:Class")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8765, help="port (0: a free one; default 8765)")
    s.add_argument("--args", default="{}", metavar="JSON", help="the class's keyword arguments, a JSON object")
    s.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        metavar="S",
        help=f"expire an episode after S seconds without a request (default {DEFAULT_IDLE_TIMEOUT_S:g})",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from single_controller.envs.inprocess import check_env_class, resolve_env_class

    args = _parser().parse_args(argv)
    try:
        serve_args = json.loads(args.args)
        if not isinstance(serve_args, dict):
            raise ValueError("not a JSON object")
        cls = resolve_env_class(args.spec)
        check_env_class(cls, args.spec, serve_args)
    except (ValueError, EnvContractError) as e:
        print(
            f"sc-grpo env serve: {e if isinstance(e, EnvContractError) else f'--args {args.args!r}: {e}'}",
            file=sys.stderr,
        )
        return 2
    factory = functools.partial(_with_args, cls, serve_args)
    try:
        asyncio.run(_serve(EnvServer(factory, args.host, args.port, idle_timeout_s=args.idle_timeout)))
    except OSError as e:
        print(f"sc-grpo env serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


async def _serve(server: EnvServer) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        print(server.url, flush=True)
        await stop.wait()
