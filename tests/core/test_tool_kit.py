"""The contract kit for tools and tool parsers (``check_tool``, ``check_tool_parser``): the built-ins pass, and each
mistake a plugin author would make is caught in one line naming the tool, the method and the rule; ``palestra
plugins`` lists tools and tool parsers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plugin_installs
import pytest

from palestra.plugins.tools.parsers import HermesParser, JsonParser
from palestra.testing import CHECKS, RULES, ContractError, check, check_tool, check_tool_parser
from palestra.tools import ParsedTurn, Tool, ToolCall

pytest.importorskip("jsonschema")


def caught(run: Callable[[], None], kind: str, label: str, method: str, rule: str) -> str:
    with pytest.raises(ContractError) as info:
        run()
    e = info.value
    message = str(e)
    assert "\n" not in message and message.startswith(f"{kind} {label!r}.{method}: rule {rule!r}: "), message
    assert (e.kind, e.label, e.method, e.rule) == (kind, label, method, rule), message
    assert rule in RULES[kind]
    return message.split(f"rule {rule!r}: ", 1)[1]


def weather(city: str, days: int = 1) -> str:
    """The forecast for a city.

    Args:
        city: The city, e.g. "Paris".
        days: How many days ahead.
    """
    return f"sunny in {city} for {days} day(s)"


def good_tool(**changes: Any) -> Tool:
    fields = dict(name="weather", description="The forecast.", fn=weather, timeout_s=2.0)
    fields["parameters"] = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city."},
            "days": {"type": "integer", "description": "How many days ahead."},
        },
        "required": ["city"],
    }
    return Tool(**{**fields, **changes})


# ---- the built-ins and the dispatch -----------------------------------------------------------------------------
def test_the_kinds_are_dispatched_by_check_and_a_tool_from_a_function_passes() -> None:
    assert CHECKS["tool"] is check_tool and CHECKS["tool_parser"] is check_tool_parser
    pytest.importorskip("transformers")
    check("tool", "calculator", examples=[{"expression": "6 * 7"}])
    check("tool", Tool.from_function(weather), examples=[{"city": "Oslo", "days": 3}])
    check("tool", lambda: [good_tool(), good_tool(name="weather2")], examples={"weather2": [{"city": "Rome"}]})
    for name in ("hermes", "json", "mistral"):
        check("tool_parser", name)


# ---- tools: seeded mistakes ----------------------------------------------------------------------------------------
def test_a_factory_that_returns_no_tool_or_two_with_one_name_is_caught() -> None:
    detail = caught(lambda: check_tool(lambda: weather, name="w"), "tool", "w", "build", "is a Tool")
    assert detail == "returned function; expected a palestra.tools.Tool (Tool.from_function(fn) builds one)"
    assert caught(lambda: check_tool(list, name="w"), "tool", "w", "build", "is a Tool") == "returned an empty list"
    detail = caught(lambda: check_tool(lambda: [good_tool(), good_tool()], name="w"), "tool", "w", "build", "is a Tool")
    assert detail == "two tools are named 'weather'"


def test_a_factory_that_raises_is_a_build_failure() -> None:
    def broken() -> Tool:
        raise OSError("no such service")

    detail = caught(lambda: check_tool(broken), "tool", "broken", "build", "builds from its options")
    assert detail == "raised OSError: no such service"


def test_an_undescribed_tool_or_parameter_and_a_bad_schema_are_caught() -> None:
    assert (
        caught(lambda: check_tool(good_tool(description=" ")), "tool", "weather", "description", "described")
        == "tool 'weather' has no description"
    )
    no_doc = good_tool(parameters={"type": "object", "properties": {"city": {"type": "string"}}})
    detail = caught(lambda: check_tool(no_doc), "tool", "weather", "parameters", "object schema")
    assert (
        detail
        == "tool 'weather': parameters: property 'city' has no description (document it under Args: in the docstring)"
    )
    untyped = good_tool(parameters={"type": "object", "properties": {"city": {"description": "The city."}}})
    detail = caught(lambda: check_tool(untyped), "tool", "weather", "parameters", "object schema")
    assert detail == "tool 'weather': parameters: property 'city' has no type"
    invalid = good_tool(parameters={"type": "object", "properties": {"city": {"type": "text", "description": "x"}}})
    detail = caught(lambda: check_tool(invalid), "tool", "weather", "parameters", "object schema")
    assert detail.startswith("tool 'weather': parameters is not valid JSON Schema: 'text' is not valid")
    ghost = good_tool(parameters={"type": "object", "properties": {}, "required": ["city"]})
    detail = caught(lambda: check_tool(ghost), "tool", "weather", "parameters", "object schema")
    assert detail == "tool 'weather': parameters: 'required' names ['city'] not in properties"


def test_a_spec_that_does_not_render_is_caught() -> None:
    class Unrenderable(Tool):
        def spec(self) -> dict[str, Any]:
            return {"type": "function", "function": {"name": self.name, "fn": self.fn}}

    tool = Unrenderable(**{k: getattr(good_tool(), k) for k in ("name", "description", "parameters", "fn")})
    detail = caught(lambda: check_tool(tool), "tool", "weather", "spec", "spec renders")
    assert detail == "raised TypeError: Object of type function is not JSON serializable"


def test_a_schema_that_lets_wrong_arguments_through_is_caught() -> None:
    class Lenient(Tool):
        def argument_error(self, arguments: Any) -> str | None:
            return None if isinstance(arguments, dict) else "not an object"

    tool = Lenient(**{k: getattr(good_tool(), k) for k in ("name", "description", "parameters", "fn")})
    detail = caught(lambda: check_tool(tool), "tool", "weather", "argument_error", "wrong arguments are caught")
    assert detail == "tool 'weather': arguments with no 'city' (required) ({}) were let through"


def test_examples_must_be_valid_run_in_time_and_return_text_or_json() -> None:
    detail = caught(
        lambda: check_tool(good_tool(), examples=[{"city": 3}]),
        "tool",
        "weather",
        "argument_error",
        "examples are valid",
    )
    assert detail == "tool 'weather' on {\"city\": 3}: argument 'city': 3 is not of type 'string'"

    def boom(city: str, days: int = 1) -> str:
        raise KeyError(city)

    detail = caught(
        lambda: check_tool(good_tool(fn=boom), examples=[{"city": "Oslo"}]), "tool", "weather", "fn", "examples run"
    )
    assert detail == "tool 'weather' on {\"city\": \"Oslo\"} raised KeyError: 'Oslo'"

    def hangs(city: str, days: int = 1) -> str:
        time.sleep(5)
        return "late"

    detail = caught(
        lambda: check_tool(good_tool(fn=hangs, timeout_s=0.1), examples=[{"city": "Oslo"}]),
        "tool",
        "weather",
        "fn",
        "examples run",
    )
    assert detail == 'tool \'weather\' on {"city": "Oslo"} did not return within 0.1 s'

    detail = caught(
        lambda: check_tool(good_tool(fn=lambda city, days=1: {1, 2}), examples=[{"city": "Oslo"}]),
        "tool",
        "weather",
        "fn",
        "result is text or JSON",
    )
    assert detail == 'tool \'weather\' on {"city": "Oslo"} returned set: Object of type set is not JSON serializable'
    detail = caught(
        lambda: check_tool(good_tool(fn=lambda city, days=1: float("nan")), examples=[{"city": "Oslo"}]),
        "tool",
        "weather",
        "fn",
        "result is text or JSON",
    )
    assert detail.startswith('tool \'weather\' on {"city": "Oslo"} returned float: Out of range float values')
    check_tool(good_tool(fn=lambda city, days=1: {"temperature": 21, "city": city}), examples=[{"city": "Oslo"}])


def test_examples_for_several_tools_must_name_them() -> None:
    both = [good_tool(), good_tool(name="other")]
    with pytest.raises(ValueError, match=r"^check_tool: the factory makes several tools; pass examples as"):
        check_tool(both, examples=[{"city": "Oslo"}])
    with pytest.raises(ValueError, match=r"^check_tool: examples name 'nope', which is not one of the tools built$"):
        check_tool(both, examples={"nope": [{}]})


# ---- parsers: seeded mistakes ------------------------------------------------------------------------------------
class Fragile(HermesParser):
    """Raises on what it cannot read, the mistake the kit exists to catch."""

    def parse(self, text: str) -> ParsedTurn:
        turn = super().parse(text)
        if turn.errors:
            raise ValueError(turn.errors[0])
        return turn


def test_a_parser_that_raises_on_broken_input_is_caught() -> None:
    detail = caught(lambda: check_tool_parser(Fragile), "tool_parser", "Fragile", "parse", "never raises")
    assert detail.startswith("raised ValueError: a <tool_call> tag is never closed")


def test_a_parser_that_reads_prose_as_a_call_or_misses_its_own_call_is_caught() -> None:
    class Eager(JsonParser):
        def parse(self, text: str) -> ParsedTurn:
            return ParsedTurn(calls=[ToolCall("calculator", {})])

    detail = caught(lambda: check_tool_parser(Eager), "tool_parser", "Eager", "parse", "plain text is final")
    assert detail == "prose was read as calls [calculator({})] and errors []"

    class Deaf(JsonParser):
        def format_call(self, call: ToolCall) -> str:
            return f"<call>{call.name}</call>"

    detail = caught(lambda: check_tool_parser(Deaf), "tool_parser", "Deaf", "parse", "reads its own call")
    assert detail.startswith("'<call>get_weather</call>' was read as calls [] and errors []; expected the one call")


def test_a_cut_off_call_read_as_a_final_answer_is_caught() -> None:
    class Forgiving(HermesParser):
        def parse(self, text: str) -> ParsedTurn:
            turn = super().parse(text)
            return ParsedTurn(calls=turn.calls)  # drops the errors: a broken call becomes the final answer

    detail = caught(
        lambda: check_tool_parser(Forgiving), "tool_parser", "Forgiving", "parse", "broken call is an error"
    )
    assert detail.startswith('the cut-off call \'<tool_call>\\n{"name": "get_w')


def test_a_parser_that_forgets_a_tool_or_has_no_format_call_is_caught() -> None:
    class Forgetful(HermesParser):
        def describe(self, tools: Any) -> str:
            return super().describe(tools[:1])

    detail = caught(
        lambda: check_tool_parser(Forgetful), "tool_parser", "Forgetful", "describe", "describe names every tool"
    )
    assert detail == "the prompt does not name ['calculator']"

    class Bare:
        parse = HermesParser.parse
        describe = HermesParser.describe

    detail = caught(lambda: check_tool_parser(Bare), "tool_parser", "Bare", "format_call", "reads its own call")
    assert detail == "the parser has no format_call(call); give it one, or pass call_text= (a turn with one call)"
    check_tool_parser(Bare, call_text='<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>')


def test_a_parser_missing_a_method_or_writing_multiline_errors_is_caught() -> None:
    class NoDescribe:
        def parse(self, text: str) -> ParsedTurn:
            return ParsedTurn()

    detail = caught(lambda: check_tool_parser(NoDescribe), "tool_parser", "NoDescribe", "build", "protocol")
    assert detail == "NoDescribe lacks parse(text) or describe(tools)"

    class Verbose(HermesParser):
        def parse(self, text: str) -> ParsedTurn:
            turn = super().parse(text)
            return ParsedTurn(turn.calls, [f"bad call:\n{e}" for e in turn.errors])

    detail = caught(lambda: check_tool_parser(Verbose), "tool_parser", "Verbose", "parse", "never raises")
    assert "an error is 'bad call:\\na <tool_call> tag" in detail and detail.endswith("expected one line")


# ---- the fixture and the listing ---------------------------------------------------------------------------------
def test_the_fixture_checks_a_tool(palestra_contract: Any) -> None:
    palestra_contract("tool", good_tool(), examples=[{"city": "Oslo"}])
    with pytest.raises(pytest.fail.Exception, match=r"^tool 'weather'.description: rule 'described'"):
        palestra_contract("tool", good_tool(description=""))


def test_palestra_plugins_lists_tools_and_tool_parsers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    table = plugin_installs.run_palestra(["plugins", "--all"], [], tmp_path)
    assert table.returncode == 0 and table.stderr == "", table.stderr
    rows = {line.split()[0]: line.split() for line in table.stdout.splitlines()[2:] if line.strip()}
    assert rows["calculator_tool"][-3:] == ["register_tools", "tools:", "calculator"]
    assert rows["tool_parsers"][-5:] == ["register_tool_parsers", "tool_parsers:", "hermes,", "json,", "mistral"]
    listed = plugin_installs.run_palestra(["plugins", "--all", "--json"], [], tmp_path)
    by_name = {row["name"]: row for row in json.loads(listed.stdout)}
    assert by_name["calculator_tool"]["tools"] == ["calculator"]
    assert by_name["tool_parsers"]["tool_parsers"] == ["hermes", "json", "mistral"]
