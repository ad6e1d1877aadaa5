"""How a policy's turn becomes a tool call (`env.tool_call`), and whether the tokenizer can write it.

`ToolCallParser.from_config` resolves `auto` (`hermes` when the chat template mentions
`<tool_call>`, else `regex`); `parse(text)` gives a `ToolCall` or None: `regex` fully matches
`env.tool_call_pattern`, `hermes` reads the first `<tool_call>{...}</tool_call>` (a malformed one is
still a call, with `ToolCall.error`, so the environment answers the policy's mistake).
`check_expressible` raises `ToolCallFormatError` when a literal piece of the format does not survive
the tokenizer's round trip (the character tokenizer has no `<`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from single_controller.envs.contract import ToolCall

if TYPE_CHECKING:
    from single_controller.config.schema import EnvConfig

Format = Literal["none", "regex", "hermes"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
HERMES_BODY = '{"name": "", "arguments": {}}'
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)


class ToolCallFormatError(ValueError):
    """A tool-call format that cannot be used: a bad pattern, or text the tokenizer cannot write."""


def chat_template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template as text ("" without one); HF tokenizers may keep several, by name."""
    if tokenizer is None or not getattr(tokenizer, "has_chat_template", False):
        return ""
    template = getattr(getattr(tokenizer, "tok", tokenizer), "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return str(template or "")


@dataclass(frozen=True)
class ToolCallParser:
    format: Format
    pattern: re.Pattern[str] | None = None  # `regex` only
    default_tool: str = "lookup"

    @classmethod
    def from_config(cls, cfg: EnvConfig, tokenizer: Any = None) -> ToolCallParser:
        fmt = cfg.tool_call
        if fmt == "auto":
            fmt = "hermes" if HERMES_OPEN in chat_template_text(tokenizer) else "regex"
        if fmt != "regex":
            return cls(fmt, None, cfg.default_tool)
        try:
            pattern = re.compile(cfg.tool_call_pattern)
        except re.error as e:
            raise ToolCallFormatError(f"env.tool_call_pattern {cfg.tool_call_pattern!r} is not a regex: {e}") from None
        if "arguments" not in pattern.groupindex:
            raise ToolCallFormatError(
                f"env.tool_call_pattern {cfg.tool_call_pattern!r} has no named group `arguments` (?P<arguments>...)"
            )
        return cls("regex", pattern, cfg.default_tool)

    def parse(self, text: str) -> ToolCall | None:
        if self.format == "regex":
            assert self.pattern is not None
            m = self.pattern.fullmatch(text)
            if m is None:
                return None
            name = m.group("name") if "name" in self.pattern.groupindex else None
            return ToolCall(name or self.default_tool, m.group("arguments") or "")
        if self.format == "hermes":
            return _parse_hermes(text)
        return None

    def literal_pieces(self) -> tuple[str, ...]:
        """The literal text the format needs the policy to write."""
        if self.format == "hermes":
            return (HERMES_OPEN, HERMES_CLOSE, HERMES_BODY)
        if self.format == "regex":
            assert self.pattern is not None
            return tuple(_required_literals(self.pattern.pattern))
        return ()


def _parse_hermes(text: str) -> ToolCall | None:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    m = _HERMES_CALL.search(text, start)
    if m is None:
        return ToolCall("", text[start:], error=f"{HERMES_OPEN} without {HERMES_CLOSE}")
    body = m.group(1)
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", body, error=f"the call is not JSON: {e}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", body, error='the call is not {"name": "...", "arguments": {...}}')
    return ToolCall(call["name"], call.get("arguments", {}))


def _required_literals(pattern: str) -> list[str]:
    """Runs of literal characters that every match of `pattern` contains (sre parse tree, LITERAL ops)."""
    from re import _constants as c  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]

    pieces: list[str] = []

    def walk(seq: Any) -> None:
        run: list[str] = []
        for op, arg in seq:
            if op is c.LITERAL:
                run.append(chr(arg))
                continue
            if run:
                pieces.append("".join(run))
                run = []
            if op is c.SUBPATTERN:
                walk(arg[-1])
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT) and arg[0] >= 1:
                walk(arg[2])
            elif op is c.ATOMIC_GROUP:
                walk(arg)
        if run:
            pieces.append("".join(run))

    walk(sre_parse.parse(pattern))
    return pieces


def check_expressible(parser: ToolCallParser, tokenizer: Any) -> None:
    """Refuse a format whose literal text the tokenizer cannot write and read back (see the contract)."""
    for piece in parser.literal_pieces():
        try:
            back = tokenizer.decode(tokenizer.encode(piece))
        except (ValueError, KeyError, TypeError) as e:
            why = str(e)
        else:
            if back == piece:
                continue
            why = f"it decodes back as {back!r}"
        raise ToolCallFormatError(
            f"env.tool_call={parser.format}: the tokenizer cannot express {piece!r}, literal text of the format "
            f"({why}); choose a format the model's vocabulary can write (env.tool_call, env.tool_call_pattern)"
        )
