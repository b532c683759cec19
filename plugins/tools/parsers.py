"""Tool-call parsers: how a model's text is read as tool calls, and how tools are described to it.

``hermes`` (the default): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of
Hermes, Qwen 2.5/3 and SmolLM3 templates, and of TRL's and verl's tool parsers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from palestra import hookimpl
from palestra.tools import ParsedTurn, decode_call

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesParser:
    """``<tool_call>{json}</tool_call>``, any number per turn; an opened tag never closed is a malformed call."""

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        for payload in _HERMES_CALL.findall(text):
            call = decode_call(payload)
            (turn.calls if not isinstance(call, str) else turn.errors).append(call)  # type: ignore[arg-type]
        rest = _HERMES_CALL.sub("", text)
        if "<tool_call>" in rest:
            turn.errors.append("a <tool_call> tag is never closed with </tool_call>")
        return turn

    def describe(self, tools: Sequence[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You may call one or more functions to help with the user's request. The functions are:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, write its name and arguments as JSON inside tags, like this:\n"
            '<tool_call>\n{"name": "<function-name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
            "The result comes back in the next message. When you have what you need, answer without a call."
        )


@hookimpl
def register_tool_parsers(register: Any) -> None:
    register("hermes", HermesParser, description="<tool_call>{json}</tool_call> (Hermes, Qwen, SmolLM3)")
