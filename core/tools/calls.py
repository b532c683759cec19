"""Tool calls as a model writes them, and the parsers that read them.

A parser (a plugin kind, ``tool_parser``) reads one assistant turn: the calls it makes, and the calls it tried to
make but wrote wrongly. A turn with neither is the model's final answer. The parser also describes the tools in its
own format, for a model whose chat template has no tool section (the policy puts that text in a system message).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["ParsedTurn", "ToolCall", "ToolCallParser", "decode_call"]


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def as_message_call(self, index: int) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry a chat template renders for this call."""
        return {"id": f"call_{index}", "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """What one assistant turn asks for: ``calls`` read, and one line per call that could not be read (broken JSON,
    no name, arguments that are not an object). Neither: the turn is the final answer."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def is_final(self) -> bool:
        return not self.calls and not self.errors


@runtime_checkable
class ToolCallParser(Protocol):
    """Reads tool calls out of a model's text, and describes tools in the same format (see the module docstring)."""

    def parse(self, text: str) -> ParsedTurn: ...

    def describe(self, tools: Sequence[dict[str, Any]]) -> str:
        """A system message teaching the model the tools (``tools``: OpenAI function specs) and how to call them."""
        ...


def decode_call(payload: str, *, arguments_key: Sequence[str] = ("arguments",)) -> ToolCall | str:
    """A :class:`ToolCall` from a JSON object ``{"name": ..., "arguments": {...}}``, or one line saying what is wrong.

    ``arguments`` may also be a JSON string holding the object (as the OpenAI API sends it); ``arguments_key`` lists
    the keys accepted for the arguments, in order (Llama's JSON format says ``parameters``)."""
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as e:
        return f"the call is not valid JSON ({e.msg} at character {e.pos}): {payload.strip()[:80]!r}"
    if not isinstance(data, dict):
        return f"the call must be a JSON object with a name and arguments, got {type(data).__name__}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return "the call has no 'name' (a string)"
    key = next((k for k in arguments_key if k in data), None)
    arguments: Any = {} if key is None else data[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"the arguments of {name!r} are a string that is not a JSON object"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name, arguments)
