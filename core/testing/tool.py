"""``check_tool`` and ``check_tool_parser``: the tool and tool-parser contracts the tool loop relies on, rule by rule.

The tool loop renders every tool's ``spec()`` into the model's prompt (as JSON, through the chat template or a
parser's ``describe``), checks the model's arguments with ``argument_error`` and calls ``fn(**arguments)`` within
``timeout_s``, sending the result back as a message. A parser's ``parse`` reads every assistant turn the model
writes, hostile or broken ones included, and must answer each with a ``ParsedTurn``, never an exception.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from palestra.testing.components import Subject, subject
from palestra.testing.errors import Contract

__all__ = ["PARSER_RULES", "RULES", "check_tool", "check_tool_parser"]

RULES: dict[str, str] = {
    "builds from its options": "the factory builds the tool from the options given",
    "is a Tool": "the factory returns a palestra.tools.Tool, or a non-empty list of them with distinct names",
    "valid name": "the name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or '_'",
    "described": "the tool has a non-empty description (the model reads it to decide when to call it)",
    "object schema": (
        "parameters is a valid JSON Schema of type 'object' whose properties each have a type and a description, "
        "and whose 'required' names only those properties"
    ),
    "spec renders": "spec() is the OpenAI function spec of the tool and json.dumps renders it",
    "examples are valid": "argument_error(example) is None for each example the check is given",
    "examples run": "fn(**example) returns within timeout_s without raising",
    "result is text or JSON": "the result is a str, or a value json.dumps renders (it becomes the tool message)",
    "wrong arguments are caught": (
        "argument_error names the problem (not None) for arguments that are not an object, that miss a required "
        "property, or that give a property a value of the wrong type"
    ),
}

PARSER_RULES: dict[str, str] = {
    "builds from its options": "the factory builds the parser from the options given",
    "protocol": "the parser has parse(text) and describe(tools) (palestra.tools.ToolCallParser)",
    "describe names every tool": "describe(tools) returns a non-empty str that names every tool",
    "plain text is final": "parse of prose with no call returns a ParsedTurn with no calls and no errors",
    "reads its own call": (
        "parse of a well-formed call (format_call(call), or the call_text given) returns exactly that call, no errors"
    ),
    "broken call is an error": "parse of a call cut off halfway returns an error line, not a call nor a final answer",
    "never raises": (
        "parse of hostile text (broken JSON, wrong types, no name, nested tags, unicode, deep nesting, 100 kB) "
        "returns a ParsedTurn of ToolCall(str, dict) calls and one-line str errors"
    ),
}

# Two tools every parser must be able to describe: OpenAI function specs, as Tool.spec() makes them.
SAMPLE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city today.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city, e.g. 'Paris'."}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. '2 + 3 * 4'"}},
                "required": ["expression"],
            },
        },
    },
]
SAMPLE_CALL = ("get_weather", {"city": "Zürich"})  # non-ASCII on purpose: parsers must keep unicode

# A value of the wrong type for each JSON Schema type.
WRONG_VALUE: dict[str, Any] = {
    "string": 12345,
    "integer": "not a number",
    "number": "not a number",
    "boolean": "not a boolean",
    "array": "not a list",
    "object": "not an object",
    "null": "not null",
}


# ---- tools ------------------------------------------------------------------------------------------------------
def check_tool(
    tool: Any,
    options: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    examples: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> None:
    """Check a registered tool (by name), a factory, or a built :class:`~palestra.tools.Tool` (or list of them)
    against the contract; raise a one-line :class:`~palestra.testing.ContractError` at the first broken rule.

    ``examples`` are arguments the tool must accept and run on: a list of argument objects (for a factory that
    makes one tool), or tool name -> such a list (for one that makes several). Without them the tool is not
    called: its definition is checked alone.
    """
    subj = _tool_subject(tool, options, name)
    c = Contract("tool", subj.label, RULES)
    with c.calling("build", "builds from its options"):
        built = subj.make()
    tools = _as_tools(built, c)
    per_tool = _examples_by_tool(examples, tools, c)
    for one in tools:
        _check_definition(one, c)
        _check_wrong_arguments(one, c)
        for example in per_tool.get(one.name, []):
            _check_example(one, example, c)


def _tool_subject(tool: Any, options: Mapping[str, Any] | None, name: str | None) -> Subject:
    from palestra.tools import Tool

    if isinstance(tool, Tool) or (isinstance(tool, (list, tuple)) and tool and isinstance(tool[0], Tool)):
        label = name or (tool.name if isinstance(tool, Tool) else tool[0].name)
        return Subject("tool", label, lambda: tool)
    return subject("tool", tool, options, name=name)


def _as_tools(built: Any, c: Contract) -> list[Any]:
    from palestra.tools import Tool

    tools = list(built) if isinstance(built, (list, tuple)) else [built]
    c.require(tools, "build", "is a Tool", "returned an empty list")
    for item in tools:
        c.require(
            isinstance(item, Tool),
            "build",
            "is a Tool",
            f"returned {type(item).__name__}; expected a palestra.tools.Tool (Tool.from_function(fn) builds one)",
        )
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    c.require(not twice, "build", "is a Tool", f"two tools are named {twice[0]!r}" if twice else "")
    return tools


def _examples_by_tool(examples: Any, tools: list[Any], c: Contract) -> dict[str, list[Mapping[str, Any]]]:
    if examples is None:
        return {}
    if isinstance(examples, Mapping):
        unknown = sorted(set(examples) - {t.name for t in tools})
        if unknown:
            raise ValueError(f"check_tool: examples name {unknown[0]!r}, which is not one of the tools built")
        return {k: list(v) for k, v in examples.items()}
    if len(tools) > 1:
        raise ValueError("check_tool: the factory makes several tools; pass examples as {tool name: [arguments]}")
    return {tools[0].name: list(examples)}


def _check_definition(tool: Any, c: Contract) -> None:
    from palestra.tools.tool import NAME_PATTERN

    label = f"tool {tool.name!r}"
    c.require(
        isinstance(tool.name, str) and NAME_PATTERN.fullmatch(tool.name),
        "name",
        "valid name",
        f"{tool.name!r} is not a tool name",
    )
    c.require(
        isinstance(tool.description, str) and tool.description.strip(),
        "description",
        "described",
        f"{label} has no description",
    )
    _check_schema(tool, c)
    with c.calling("spec", "spec renders"):
        spec = tool.spec()
        json.dumps(spec)
    function = spec.get("function") if isinstance(spec, Mapping) else None
    c.require(
        isinstance(function, Mapping) and function.get("name") == tool.name and spec.get("type") == "function",
        "spec",
        "spec renders",
        f"{label}: spec() is {str(spec)[:100]!r}; expected {{'type': 'function', 'function': {{'name': ...}}}}",
    )


def _check_schema(tool: Any, c: Contract) -> None:
    try:
        import jsonschema
    except ImportError as e:
        from palestra.registry import MissingDependency

        raise MissingDependency("check_tool", "jsonschema", 'pip install "palestra[tools]"', cause=e) from None

    schema = tool.parameters
    where = f"tool {tool.name!r}: parameters"
    c.require(
        isinstance(schema, Mapping) and schema.get("type") == "object",
        "parameters",
        "object schema",
        f"{where} is {str(schema)[:80]!r}; expected a JSON Schema of type 'object'",
    )
    try:
        jsonschema.Draft202012Validator.check_schema(dict(schema))
    except jsonschema.SchemaError as e:
        raise c.fail("parameters", "object schema", f"{where} is not valid JSON Schema: {e.message}") from e
    properties = schema.get("properties", {})
    c.require(isinstance(properties, Mapping), "parameters", "object schema", f"{where}.properties is not an object")
    for key, prop in properties.items():
        typed = isinstance(prop, Mapping) and any(k in prop for k in ("type", "enum", "anyOf", "oneOf", "const"))
        c.require(typed, "parameters", "object schema", f"{where}: property {key!r} has no type")
        described = isinstance(prop.get("description"), str) and prop["description"].strip()
        c.require(
            described,
            "parameters",
            "object schema",
            f"{where}: property {key!r} has no description (document it under Args: in the docstring)",
        )
    missing = [k for k in schema.get("required", []) if k not in properties]
    c.require(not missing, "parameters", "object schema", f"{where}: 'required' names {missing} not in properties")


def _wrong_arguments(tool: Any) -> list[tuple[str, Any]]:
    """(what is wrong, arguments) the schema must refuse."""
    schema = tool.parameters
    properties = schema.get("properties", {})
    required = list(schema.get("required", []))
    cases: list[tuple[str, Any]] = [("a list instead of an object", [1, 2])]
    if required:
        cases.append((f"no {required[0]!r} (required)", {}))
    filled = {k: _plausible(properties.get(k, {})) for k in required}
    for key, prop in properties.items():
        kind = prop.get("type") if isinstance(prop, Mapping) else None
        if isinstance(kind, str) and kind in WRONG_VALUE:
            cases.append((f"{key!r} given a value that is not {kind}", {**filled, key: WRONG_VALUE[kind]}))
    return cases


def _plausible(prop: Mapping[str, Any]) -> Any:
    """A value of the right type, so that a wrong-type case is wrong for one reason only."""
    if prop.get("enum"):
        return prop["enum"][0]
    kind = prop.get("type")
    values: dict[str, Any] = {"string": "x", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    return values.get(kind) if isinstance(kind, str) else None


def _check_wrong_arguments(tool: Any, c: Contract) -> None:
    for what, arguments in _wrong_arguments(tool):
        with c.calling("argument_error", "wrong arguments are caught"):
            why = tool.argument_error(arguments)
        c.require(
            isinstance(why, str) and why.strip(),
            "argument_error",
            "wrong arguments are caught",
            f"tool {tool.name!r}: arguments with {what} ({str(arguments)[:60]}) were let through",
        )


def _check_example(tool: Any, example: Mapping[str, Any], c: Contract) -> None:
    label = f"tool {tool.name!r} on {json.dumps(example, default=str)[:80]}"
    why = tool.argument_error(example)
    c.require(why is None, "argument_error", "examples are valid", f"{label}: {why}")
    result = _call_within(tool, dict(example), c, label)
    if isinstance(result, str):
        return
    try:
        json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise c.fail("fn", "result is text or JSON", f"{label} returned {type(result).__name__}: {e}") from e


def _call_within(tool: Any, arguments: dict[str, Any], c: Contract, label: str) -> Any:
    """``fn(**arguments)`` in a daemon thread, as the tool loop calls it, failing the check past ``timeout_s``."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["result"] = tool.fn(**arguments)
        except BaseException as e:  # noqa: BLE001 - handed to the checking thread
            outcome["error"] = e

    worker = threading.Thread(target=call, name=f"check_tool {tool.name}", daemon=True)
    worker.start()
    worker.join(tool.timeout_s if math.isfinite(tool.timeout_s) else None)
    c.require(not worker.is_alive(), "fn", "examples run", f"{label} did not return within {tool.timeout_s} s")
    if "error" in outcome:
        e = outcome["error"]
        text = (str(e).strip().splitlines() or [""])[0][:200]
        raise c.fail("fn", "examples run", f"{label} raised {type(e).__name__}: {text}") from e
    return outcome.get("result")


# ---- tool parsers -----------------------------------------------------------------------------------------------
def check_tool_parser(
    parser: str | Callable[..., Any],
    options: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    call_text: str | None = None,
) -> None:
    """Check a registered tool parser (by name) or a factory against the contract; raise a one-line
    :class:`~palestra.testing.ContractError` at the first broken rule.

    ``tools`` are the OpenAI function specs ``describe`` is given (default: two sample tools). The well-formed
    call is the parser's own ``format_call(ToolCall("get_weather", {"city": "Zürich"}))``, or ``call_text``
    (a turn holding that one call, written in the parser's format) for a parser without ``format_call``.
    """
    from palestra.tools import ToolCallParser

    subj = subject("tool_parser", parser, options, name=name)
    c = Contract("tool_parser", subj.label, PARSER_RULES)
    with c.calling("build", "builds from its options"):
        built = subj.make()
    c.require(
        isinstance(built, ToolCallParser),
        "build",
        "protocol",
        f"{type(built).__name__} lacks parse(text) or describe(tools)",
    )
    _check_describe(built, c, list(tools or SAMPLE_TOOLS))
    final = _parse(built, c, "The answer is 42. Nothing to call here.")
    c.require(final.is_final, "parse", "plain text is final", f"prose was read as {_shown(final)}")
    good = _own_call(built, c, call_text)
    _check_cut_off(built, c, good)
    for text in _hostile_texts(good):
        _parse(built, c, text)


def _check_describe(parser: Any, c: Contract, tools: list[Mapping[str, Any]]) -> None:
    with c.calling("describe", "describe names every tool"):
        text = parser.describe(tools)
    c.require(
        isinstance(text, str) and text.strip(),
        "describe",
        "describe names every tool",
        f"returned {type(text).__name__} {str(text)[:40]!r}; expected the tool prompt, a non-empty str",
    )
    names = [t["function"]["name"] for t in tools]
    missing = [n for n in names if n not in text]
    c.require(not missing, "describe", "describe names every tool", f"the prompt does not name {missing}")


def _parse(parser: Any, c: Contract, text: str) -> Any:
    from palestra.tools import ParsedTurn, ToolCall

    shown = text if len(text) <= 40 else text[:30] + f"... ({len(text)} characters)"
    with c.calling("parse", "never raises"):
        turn = parser.parse(text)
    c.require(isinstance(turn, ParsedTurn), "parse", "never raises", f"returned {type(turn).__name__} on {shown!r}")
    for call in turn.calls:
        ok = isinstance(call, ToolCall) and isinstance(call.name, str) and isinstance(call.arguments, dict)
        c.require(ok, "parse", "never raises", f"on {shown!r} a call is {str(call)[:60]}; expected ToolCall(str, dict)")
    for error in turn.errors:
        line = isinstance(error, str) and bool(error.strip()) and "\n" not in error
        c.require(line, "parse", "never raises", f"on {shown!r} an error is {str(error)[:60]!r}; expected one line")
    return turn


def _own_call(parser: Any, c: Contract, call_text: str | None) -> str:
    from palestra.tools import ToolCall

    expected = ToolCall(*SAMPLE_CALL)
    if call_text is None:
        c.require(
            callable(getattr(parser, "format_call", None)),
            "format_call",
            "reads its own call",
            "the parser has no format_call(call); give it one, or pass call_text= (a turn with one call)",
        )
        with c.calling("format_call", "reads its own call"):
            call_text = parser.format_call(expected)
    turn = _parse(parser, c, call_text)
    c.require(
        turn.calls == [expected] and not turn.errors,
        "parse",
        "reads its own call",
        f"{call_text[:80]!r} was read as {_shown(turn)}; expected the one call {expected}",
    )
    return call_text


def _check_cut_off(parser: Any, c: Contract, good: str) -> None:
    half = good[: max(1, len(good) // 2)]
    turn = _parse(parser, c, half)
    c.require(
        turn.errors and not turn.calls,
        "parse",
        "broken call is an error",
        f"the cut-off call {half!r} was read as {_shown(turn)}",
    )


def _hostile_texts(good: str) -> list[str]:
    """Turns a model may write: each must come back as a ParsedTurn (the parser's own format mixed in)."""
    return [
        "",
        "   \n\t",
        good.replace('"get_weather"', "12"),  # a name that is not a string
        good.replace('"name"', '"nom"'),  # no name
        good.replace('{"city": "Zürich"}', '"not an object"'),  # arguments of the wrong type
        good.replace('"Zürich"', '"Zürich'),  # an unterminated string
        good + good,  # two calls back to back
        "<tool_call><tool_call>" + good + "</tool_call></tool_call>",  # nested tags
        '<tool_call>{"name": "a", "arguments": {}}',  # a tag never closed
        "[TOOL_CALLS]" + "[" * 50_000,  # nesting deeper than json's recursion limit
        "{" * 50_000,
        "<|python_tag|>" + "[" * 50_000,
        "\x00\ud800 ☃ 計算 \U0001f9ee",  # NUL, a lone surrogate, unicode
        '{"name": "a", "parameters": ' + '"' + "x" * 100_000 + '"}',  # 100 kB
        "<tool_call>" * 5_000,
    ]


def _shown(turn: Any) -> str:
    calls = ", ".join(f"{call.name}({call.arguments})" for call in turn.calls)[:80]
    return f"calls [{calls}] and errors {[e[:60] for e in turn.errors]}"
