"""An environment over HTTP (`env.url`): the client of the JSON protocol of docs/environments.md.

`HttpEnvironment` is one episode: `reset`, `step` and `close` POST to the server (standard library
only, one request per connection). Every call has the deadline `timeout_s`, and any transport or
protocol failure raises `EnvFailed` naming the call, the episode and the url; the runner decides what
to retry. `check_env_url` (before start-up) checks `GET /health` speaks `sc-grpo-env/1`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import urllib.parse
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from single_controller.envs.contract import Action, EnvContractError, EnvFailed, EpisodeItem, StepOutcome

PROTOCOL = "sc-grpo-env/1"
MAX_BODY_BYTES = 16 * 2**20  # an answer past this is refused: observations are text for one turn


class EnvUnreachable(EnvContractError):
    """`env.url` did not answer /health (refused, unresolvable, or past the deadline)."""


class HttpProtocolError(Exception):
    """The peer answered, but not HTTP/1.1 with a JSON body."""


@dataclass(frozen=True)
class Endpoint:
    """Where a server is: `http(s)://host:port/prefix` (the protocol's paths go after `prefix`)."""

    url: str
    host: str
    port: int
    tls: bool
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EnvContractError(f"env.url {url!r} is not an http:// or https:// URL with a host")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as e:
            raise EnvContractError(f"env.url {url!r}: {e}") from None
        return cls(url.rstrip("/"), parts.hostname, port, parts.scheme == "https", parts.path.rstrip("/"))


async def http_call(ep: Endpoint, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
    """One request on its own connection: (status, the JSON body). Raises OSError, `HttpProtocolError`;
    the caller holds the deadline."""
    body = b"" if payload is None else json.dumps(payload).encode()
    head = (
        f"{method} {ep.prefix}{path} HTTP/1.1\r\nHost: {ep.host}:{ep.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(
        ep.host, ep.port, ssl=ssl.create_default_context() if ep.tls else None
    )
    try:
        writer.write(head + body)
        await writer.drain()
        status, raw = await _read_response(reader)
    finally:
        writer.transport.abort()  # one request per connection; nothing left to flush
    try:
        return status, json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HttpProtocolError(f"HTTP {status} with a body that is not JSON ({e}): {raw[:200]!r}") from None


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    line = await reader.readline()
    if not line:
        raise HttpProtocolError("the connection closed without an answer")
    fields = line.decode("latin-1").split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        raise HttpProtocolError(f"not an HTTP status line: {line[:200]!r}")
    headers = await read_headers(reader)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return int(fields[1]), await _read_chunked(reader)
    if "content-length" in headers:
        size = int(headers["content-length"])
        if size > MAX_BODY_BYTES:
            raise HttpProtocolError(f"an answer of {size} bytes (at most {MAX_BODY_BYTES})")
        return int(fields[1]), await reader.readexactly(size)
    return int(fields[1]), await reader.read(MAX_BODY_BYTES)


async def read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    """HTTP/1.1 header lines up to the blank line, names lowercased (shared with the server)."""
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            return headers
        if not line:
            raise HttpProtocolError("the connection closed inside the headers")
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise HttpProtocolError(f"not a header line: {line[:200]!r}")
        headers[name.strip().lower()] = value.strip()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return bytes(out)
        if len(out) + size > MAX_BODY_BYTES:
            raise HttpProtocolError(f"a chunked answer over {MAX_BODY_BYTES} bytes")
        out += await reader.readexactly(size)
        await reader.readline()  # the chunk's CRLF


def item_json(item: EpisodeItem) -> dict[str, Any]:
    out = asdict(item)
    out["columns"] = dict(item.columns)
    return out


def action_json(action: Action) -> dict[str, Any]:
    call = action.tool_call
    tool = None if call is None else {"name": call.name, "arguments": call.arguments, "error": call.error}
    return {"text": action.text, "tool_call": tool}


class HttpEnvironment:
    """One episode of the environment at `url` (see the module's contract)."""

    def __init__(self, url: str, *, timeout_s: float, args: Mapping[str, Any] | None = None):
        self.endpoint = Endpoint.parse(url)
        self.url = self.endpoint.url
        self.timeout_s = timeout_s
        self.args = dict(args or {})
        self.episode: str | None = None

    async def reset(self, item: EpisodeItem) -> str:
        if self.episode is not None:
            raise EnvFailed("reset", self.episode, "this episode was reset already (one HttpEnvironment per episode)")
        self.episode = f"{item.prompt_id}.{item.index}.a{item.attempt}.{uuid.uuid4().hex[:12]}"
        answer = await self._call("reset", {"episode": self.episode, "item": item_json(item), "args": self.args})
        observation = answer.get("observation")
        if not isinstance(observation, str):
            raise EnvFailed("reset", self.episode, f"{self.url}/reset answered no string observation: {answer!r:.200}")
        return observation

    async def step(self, action: Action) -> StepOutcome:
        if self.episode is None:
            raise EnvFailed("step", "(none)", f"step before reset at {self.url}")
        answer = await self._call("step", {"episode": self.episode, "action": action_json(action)})
        try:
            return outcome_from_json(answer)
        except (TypeError, ValueError) as e:
            raise EnvFailed("step", self.episode, f"{self.url}/step answered {answer!r:.200}: {e}") from None

    async def close(self) -> None:
        if self.episode is not None:
            await self._call("close", {"episode": self.episode})

    async def _call(self, what: str, payload: dict[str, Any]) -> dict[str, Any]:
        episode = self.episode or "(none)"
        where = f"POST {self.url}/{what}"
        try:
            async with asyncio.timeout(self.timeout_s):
                status, answer = await http_call(self.endpoint, "POST", f"/{what}", payload)
        except TimeoutError:
            raise EnvFailed(what, episode, f"{where}: no answer within env.timeout_s={self.timeout_s:g} s") from None
        except (OSError, asyncio.IncompleteReadError, HttpProtocolError, ValueError, TypeError) as e:
            raise EnvFailed(what, episode, f"{where}: {type(e).__name__}: {e}") from e
        if not 200 <= status < 300:
            error = answer.get("error", answer) if isinstance(answer, dict) else answer
            raise EnvFailed(what, episode, f"{where}: HTTP {status}: {error!r:.300}")
        if not isinstance(answer, dict):
            raise EnvFailed(what, episode, f"{where}: the answer is not a JSON object: {answer!r:.200}")
        return answer


def outcome_from_json(answer: Mapping[str, Any]) -> StepOutcome:
    """The protocol's step answer as a `StepOutcome` (TypeError/ValueError when it is not one)."""
    observation, reward, done = answer.get("observation", ""), answer.get("reward"), answer.get("done", False)
    info = answer.get("info") or {}
    if not isinstance(observation, str) or not isinstance(done, bool) or not isinstance(info, dict):
        raise TypeError("expected {observation: str, reward: number|null, done: bool, info: object}")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise TypeError(f"reward must be a number or null, got {reward!r}")
    return StepOutcome(observation, None if reward is None else float(reward), done, info)


def check_env_url(url: str, timeout_s: float) -> None:
    """`GET url/health` answers the protocol within `timeout_s` (see the module's contract)."""
    ep = Endpoint.parse(url)
    conn_type = http.client.HTTPSConnection if ep.tls else http.client.HTTPConnection
    conn = conn_type(ep.host, ep.port, timeout=timeout_s)
    try:
        conn.request("GET", f"{ep.prefix}/health")
        response = conn.getresponse()
        status, raw = response.status, response.read(MAX_BODY_BYTES)
    except TimeoutError:
        raise EnvUnreachable(f"env.url {url}: GET /health had no answer within env.timeout_s={timeout_s:g} s") from None
    except (OSError, http.client.HTTPException) as e:
        raise EnvUnreachable(
            f"env.url {url}: GET /health failed: {type(e).__name__}: {e} (is the server running? `sc-grpo env serve`)"
        ) from None
    finally:
        conn.close()
    try:
        answer = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        answer = None
    if status != 200 or not isinstance(answer, dict) or answer.get("protocol") != PROTOCOL:
        raise EnvContractError(
            f'env.url {url}: GET /health answered HTTP {status} {raw[:200]!r}, not {{"protocol": "{PROTOCOL}"}} '
            "(an sc-grpo environment server: `sc-grpo env serve`, or one of docs/environments.md's protocol)"
        )
