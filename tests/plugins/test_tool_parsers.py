"""The tool-call parsers: ``hermes``, ``json`` (Llama 3.1/3.2) and ``mistral`` read well-formed calls, call prose a
final answer, and turn every broken call into an error line (never an exception), hostile text included."""

from __future__ import annotations

import json

import pytest

from palestra.plugin_manager import get_registry
from palestra.plugins.tools.parsers import HermesParser, JsonParser, MistralParser
from palestra.testing import check_tool_parser
from palestra.tools import ParsedTurn, ToolCall

PARSERS = {"hermes": HermesParser, "json": JsonParser, "mistral": MistralParser}


@pytest.mark.parametrize("name", list(PARSERS))
def test_each_parser_is_registered_and_keeps_the_contract(name: str) -> None:
    assert get_registry().get("tool_parser", name).factory is PARSERS[name]
    check_tool_parser(name)


# ---- json --------------------------------------------------------------------------------------------------------
def test_json_reads_one_call_with_parameters_or_arguments_after_an_optional_python_tag() -> None:
    parser = JsonParser()
    want = [ToolCall("calculator", {"expression": "12*47"})]
    assert parser.parse('{"name": "calculator", "parameters": {"expression": "12*47"}}').calls == want
    assert parser.parse('  {"name": "calculator", "arguments": {"expression": "12*47"}}\n').calls == want
    turn = parser.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "12*47"}}<|eom_id|>')
    assert turn.calls == want and not turn.errors
    # the OpenAI API's habit: arguments as a JSON string holding the object
    assert parser.parse('{"name": "calculator", "arguments": "{\\"expression\\": \\"12*47\\"}"}').calls == want


def test_json_reads_a_list_of_calls_and_reports_each_bad_item() -> None:
    text = json.dumps(
        [{"name": "a", "parameters": {"x": 1}}, {"parameters": {}}, 7, {"name": "b", "parameters": [1]}, {"name": "c"}]
    )
    turn = JsonParser().parse(text)
    assert turn.calls == [ToolCall("a", {"x": 1}), ToolCall("c", {})]
    assert turn.errors == [
        "the call has no 'name' (a string)",
        "the call must be a JSON object with a name and arguments, got int",
        "the arguments of 'b' must be a JSON object, got list",
    ]
    assert JsonParser().parse("[]").errors == ["the call is an empty list: name at least one call"]


def test_json_calls_prose_a_final_answer_and_broken_json_a_malformed_call() -> None:
    parser = JsonParser()
    for prose in ("The answer is 564.", "564", "", "I will call {calculator} now", "<|python_tag|>hello"):
        assert parser.parse(prose).is_final, prose
    for broken, start in (
        ('{"name": "calculator", "parameters": {"expression": "1+1"}', "the call is not valid JSON ("),
        ('{"name": "calculator"} and then some words', "the call is not valid JSON (Extra data"),
        ("[1, 2", "the call is not valid JSON ("),
        ('{"name": 5, "parameters": {}}', "the call has no 'name'"),
        ('{"name": "calculator", "parameters": "1+1"}', "the arguments of 'calculator' are a string"),
    ):
        turn = parser.parse(broken)
        assert not turn.is_final and not turn.calls, broken
        assert len(turn.errors) == 1 and turn.errors[0].startswith(start), turn.errors


def test_json_describe_teaches_its_own_format_and_lists_each_tool() -> None:
    spec = {"type": "function", "function": {"name": "calculator", "description": "Do sums.", "parameters": {}}}
    text = JsonParser().describe([spec])
    assert '"name": "calculator"' in text and '{"name": "<function-name>", "parameters": {' in text
    call = ToolCall("calculator", {"expression": "3 \u00d7 4 \u8a08"})
    assert JsonParser().parse(JsonParser().format_call(call)).calls == [call]  # unicode kept


# ---- mistral -----------------------------------------------------------------------------------------------------
def test_mistral_reads_calls_after_its_tag_and_prose_without_it_is_final() -> None:
    parser = MistralParser()
    turn = parser.parse('Let me compute. [TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2+2"}}]</s>')
    assert turn.calls == [ToolCall("calculator", {"expression": "2+2"})] and not turn.errors
    assert parser.parse("Four. No tags here, even with {json}.").is_final
    broken = parser.parse('[TOOL_CALLS][{"name": "calculator", "arguments": {')
    assert not broken.calls and broken.errors[0].startswith("the call after [TOOL_CALLS] is not valid JSON")
    two = parser.parse('[TOOL_CALLS][{"name": "a", "arguments": {}}][TOOL_CALLS][{"name": "b", "arguments": {}}]')
    assert [c.name for c in two.calls] == ["a", "b"]


# ---- every parser on hostile text ----------------------------------------------------------------------------------
HOSTILE = [
    "[" * 100_000,  # past json's recursion limit
    "<|python_tag|>" + "{" * 100_000,
    "[TOOL_CALLS]" + "[" * 100_000,
    "<tool_call>" + "[" * 100_000 + "</tool_call>",
    '<tool_call><tool_call>{"name": "a", "arguments": {}}</tool_call></tool_call>',
    "<tool_call>" * 10_000,
    '{"name": "計算", "parameters": {"式": "\ud800"}}',
    "\x00" * 1000,
    '{"name": "a", "parameters": {"x": "' + "y" * 100_000 + '"}}',
]


@pytest.mark.parametrize("name", list(PARSERS))
@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_text_is_a_parsed_turn_never_an_exception(name: str, text: str) -> None:
    turn = PARSERS[name]().parse(text)
    assert isinstance(turn, ParsedTurn)
    assert all(isinstance(e, str) and "\n" not in e and len(e) < 300 for e in turn.errors), turn.errors


def test_deep_nesting_is_one_error_line_for_each_format() -> None:
    deep = "[" * 100_000
    assert HermesParser().parse(f"<tool_call>{deep}</tool_call>").errors == ["the call nests JSON too deeply to read"]
    assert JsonParser().parse(deep).errors == ["the call nests JSON too deeply to read"]
    assert MistralParser().parse("[TOOL_CALLS]" + deep).errors == ["the call nests JSON too deeply to read"]


def test_nested_hermes_tags_are_a_malformed_call_not_a_final_answer() -> None:
    turn = HermesParser().parse('<tool_call><tool_call>{"name": "a", "arguments": {}}</tool_call></tool_call>')
    assert not turn.is_final and turn.errors and turn.errors[0].startswith("the call is not valid JSON")
