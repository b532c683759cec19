"""Requests in, responses out: an agent's OpenAI chat request as the episode's next observation, and the sampled
text as an OpenAI response (the shapes the official ``openai`` client parses).

Token for token: the agent echoes back each assistant message it was answered (its content and ``tool_calls``).
Each one that matches a response this episode was given becomes ``Message("assistant", <the exact sampled
text>)``, so the rendered prompt holds exactly the sampled tokens and the next turn's prompt extends the last one
(:mod:`palestra.engine.trajectory`). A message that matches none (an agent that edits its history) is kept as the
agent wrote it; that episode then trains as per-turn rows.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from palestra.tools.calls import ToolCallParser
from palestra.types import Message

__all__ = ["Given", "RequestError", "chat_response", "completion_response", "read_messages", "to_messages"]

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP status and one line for the agent."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error shape, which the ``openai`` client turns into its exception's message."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}


@dataclass
class Given:
    """One response an episode was given: the exact sampled text, and the content and calls the agent saw."""

    sampled: str
    content: str | None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    used: bool = False


def text_of(content: Any, where: str) -> str | None:
    """A message's content as text: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(400, f"{where}.content[{k}]: only text parts are served ({{'type': 'text', ...}})")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(400, f"{where}.content: expected a string, null or a list of text parts")


def read_messages(value: Any) -> list[dict[str, Any]]:
    """The request's ``messages``, checked: a non-empty list of ``{role, content}`` objects; a RequestError names the
    first bad one."""
    if not isinstance(value, list) or not value:
        raise RequestError(400, "'messages' must be a non-empty list of messages", "missing_messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise RequestError(400, f"{where}: expected an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(400, f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}")
        content = text_of(m.get("content"), where)
        calls = m.get("tool_calls") if role == "assistant" else None
        if content is None and not calls:
            raise RequestError(400, f"{where}.content: missing (only an assistant message with tool_calls may omit it)")
        out.append({"role": role, "content": content, "tool_calls": _read_calls(calls, where)})
    return out


def _read_calls(calls: Any, where: str) -> list[tuple[str, Any]]:
    """An assistant message's ``tool_calls`` as ``(name, arguments)`` pairs, the arguments parsed from their JSON."""
    if not calls:
        return []
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}.tool_calls: expected a list")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise RequestError(
                400, f"{where}.tool_calls[{k}]: expected {{'function': {{'name': ..., 'arguments': ...}}}}"
            )
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # if not JSON, compared as the string the agent sent
                arguments = json.loads(arguments)
        out.append((fn["name"], arguments))
    return out


def to_messages(messages: Sequence[Mapping[str, Any]], given: Sequence[Given]) -> tuple[list[Message], bool]:
    """The request's messages as the observation's, and whether every assistant message was one the episode was
    given (each then replaced by its exact sampled text; see the module docstring)."""
    for g in given:
        g.used = False
    out, exact = [], True
    for m in messages:
        if m["role"] == "assistant":
            match = next((g for g in given if not g.used and _same(g, m)), None)
            if match is not None:
                match.used = True
                out.append(Message("assistant", match.sampled))
                continue
            exact = False
            text = (m["content"] or "") + "".join(
                f"\n{json.dumps({'name': n, 'arguments': a})}" for n, a in m["tool_calls"]
            )
            out.append(Message("assistant", text))
        else:
            role = "system" if m["role"] == "developer" else m["role"]
            out.append(Message(role, m["content"] or ""))
    return out, exact


def _same(given: Given, message: Mapping[str, Any]) -> bool:
    if given.calls or message["tool_calls"]:
        return given.calls == message["tool_calls"]
    return (given.content or "") == (message["content"] or "")


def plain_text(messages: Sequence[Message]) -> str:
    """The messages as plain text, for a policy without a chat template; each message's text is appended to the
    last (an assistant turn as sampled, a tool result in Hermes' response tags), so it extends turn by turn."""
    pieces = []
    for m in messages:
        if m.role == "assistant":
            pieces.append(m.content)
        elif m.role == "tool":
            pieces.append(f"\n<tool_response>\n{m.content}\n</tool_response>\n")
        else:
            pieces.append(f"{m.content}\n")
    return "".join(pieces)


def answer(text: str, parser: ToolCallParser) -> Given:
    """What the agent is told of a sampled turn: its tool calls (read by the configured parser), or the text."""
    parsed = parser.parse(text)
    if parsed.calls:
        return Given(text, None, [(c.name, c.arguments) for c in parsed.calls])
    return Given(text, text)


def chat_response(given: Given, model: str, episode: str, turn: int) -> dict[str, Any]:
    """A ``chat.completion`` object for one sampled turn (``tool_calls`` when the parser read calls in it)."""
    message: dict[str, Any] = {"role": "assistant", "content": given.content}
    if given.calls:
        message["tool_calls"] = [
            {
                "id": f"call_{episode[:8]}_{turn}_{k}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
            for k, (name, arguments) in enumerate(given.calls)
        ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if given.calls else "stop",
                "logprobs": None,
            }
        ],
    }


def completion_response(text: str, model: str) -> dict[str, Any]:
    """A ``text_completion`` object for one sampled turn of ``/v1/completions``."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
    }
