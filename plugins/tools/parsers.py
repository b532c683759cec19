"""Tool-call parsers: how a model's text is read as tool calls, and how tools are described to it.

``hermes`` (the default): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of
Hermes, Qwen 2.5/3 and SmolLM3 templates, and of TRL's and verl's tool parsers.

``json``: the turn is one JSON object ``{"name": ..., "parameters": {...}}`` (or a JSON list of them), after an
optional ``<|python_tag|>``: the format of Llama 3.1/3.2's JSON tool calling. A turn that does not start with
``{`` or ``[`` is a final answer; one that does, but is not such JSON, is a malformed call.

``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}`` (Mistral's templates).

Each parser also has ``format_call(call) -> str``: the text a model writes for one call, the same example its
``describe`` teaches (the contract kit, ``palestra.testing.check_tool_parser``, parses it back).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from palestra import hookimpl
from palestra.tools import ParsedTurn, ToolCall, decode_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _tagged(text: str) -> tuple[list[str], bool]:
    """The payloads between each ``<tool_call>`` and the next ``</tool_call>``, and whether a tag is left open.

    A scan with ``str.find``, linear in the text: the regex ``<tool_call>(.*?)</tool_call>`` it replaces rescans to
    the end from every opening tag that is never closed, quadratic on a turn of many such tags."""
    payloads: list[str] = []
    at = text.find(OPEN)
    while at >= 0:
        end = text.find(CLOSE, at + len(OPEN))
        if end < 0:
            return payloads, True
        payloads.append(text[at + len(OPEN) : end])
        at = text.find(OPEN, end + len(CLOSE))
    return payloads, False


class HermesParser:
    """``<tool_call>{json}</tool_call>``, any number per turn; an opened tag never closed is a malformed call."""

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        payloads, left_open = _tagged(text)
        for payload in payloads:
            call = _decode_one(payload, ("arguments",))
            (turn.calls if not isinstance(call, str) else turn.errors).append(call)  # type: ignore[arg-type]
        if left_open:
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

    def format_call(self, call: ToolCall) -> str:
        payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"<tool_call>\n{payload}\n</tool_call>"


PYTHON_TAG = "<|python_tag|>"
# Llama's templates name the arguments "parameters"; the OpenAI format (and models trained on it) "arguments".
_JSON_ARGUMENT_KEYS = ("parameters", "arguments")


NESTED_TOO_DEEP = "the call nests JSON too deeply to read"


def _decode_one(payload: Any, keys: Sequence[str], *, decoded: bool = False) -> ToolCall | str:
    """:func:`decode_call` of a JSON text, or of an item already ``decoded`` (re-encoded, so that its checks apply)."""
    # json recurses once per nesting level: "[[[[..." from a model must be an error line, not a crash.
    try:
        return decode_call(json.dumps(payload) if decoded else payload, arguments_key=keys)
    except RecursionError:
        return NESTED_TOO_DEEP


def _decode_calls(payload: str, keys: Sequence[str], where: str) -> ParsedTurn:
    """One call object or a list of them, each read by :func:`decode_call` (``where`` names the format in errors)."""
    turn = ParsedTurn()
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as e:
        turn.errors.append(f"{where} is not valid JSON ({e.msg} at character {e.pos}): {payload.strip()[:80]!r}")
        return turn
    except RecursionError:
        turn.errors.append(NESTED_TOO_DEEP)
        return turn
    items = data if isinstance(data, list) else [data]
    if not items:
        turn.errors.append(f"{where} is an empty list: name at least one call")
    for item in items:
        call = _decode_one(item, keys, decoded=True)
        (turn.calls if not isinstance(call, str) else turn.errors).append(call)  # type: ignore[arg-type]
    return turn


class JsonParser:
    """Llama 3.1/3.2's JSON tool calls: the whole turn is ``{"name": ..., "parameters": {...}}`` or a list of them."""

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].strip()
        # Llama ends a call with <|eom_id|> / <|eot_id|>; a tokenizer that keeps special tokens leaves them here.
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).rstrip()
        if not body.startswith(("{", "[")):
            return ParsedTurn()  # prose: the final answer
        return _decode_calls(body, _JSON_ARGUMENT_KEYS, "the call")

    def describe(self, tools: Sequence[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=2) for t in tools)
        return (
            "You may call functions to help with the user's request. The functions are:\n\n"
            f"{listed}\n\n"
            "To call a function, reply with only a JSON object, nothing before or after it, like this:\n"
            '{"name": "<function-name>", "parameters": {<arguments as JSON>}}\n'
            "To call several at once, reply with a JSON list of such objects. The result comes back in the next "
            "message. When you have what you need, answer in plain words, not JSON."
        )

    def format_call(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)


MISTRAL_TAG = "[TOOL_CALLS]"


class MistralParser:
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``: text before the tag is kept as the model's words."""

    def parse(self, text: str) -> ParsedTurn:
        at = text.find(MISTRAL_TAG)
        if at < 0:
            return ParsedTurn()
        body = text[at + len(MISTRAL_TAG) :].strip().removesuffix("</s>").rstrip()
        if MISTRAL_TAG in body:  # a second tag: the model wrote two call blocks; each is read
            turn = ParsedTurn()
            for part in body.split(MISTRAL_TAG):
                one = _decode_calls(part.strip(), ("arguments", "parameters"), f"the call after {MISTRAL_TAG}")
                turn.calls += one.calls
                turn.errors += one.errors
            return turn
        return _decode_calls(body, ("arguments", "parameters"), f"the call after {MISTRAL_TAG}")

    def describe(self, tools: Sequence[dict[str, Any]]) -> str:
        listed = json.dumps(list(tools), ensure_ascii=False)
        return (
            f"[AVAILABLE_TOOLS]{listed}[/AVAILABLE_TOOLS]\n"
            "You may call these functions to help with the user's request. To call them, reply with "
            f"{MISTRAL_TAG} then a JSON list of calls, like this:\n"
            f'{MISTRAL_TAG}[{{"name": "<function-name>", "arguments": {{<arguments as JSON>}}}}]\n'
            "The result comes back in the next message. When you have what you need, answer without a call."
        )

    def format_call(self, call: ToolCall) -> str:
        return MISTRAL_TAG + json.dumps([{"name": call.name, "arguments": call.arguments}], ensure_ascii=False)


@hookimpl
def register_tool_parsers(register: Any) -> None:
    register("hermes", HermesParser, description="<tool_call>{json}</tool_call> (Hermes, Qwen, SmolLM3)")
    register("json", JsonParser, description='{"name": ..., "parameters": {...}} as the whole turn (Llama 3.1/3.2)')
    register("mistral", MistralParser, description="[TOOL_CALLS][{json}, ...] (Mistral)")
