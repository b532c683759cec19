"""The built-in ``calculator`` tool: exact arithmetic through an AST walk, no ``eval``, every number bounded; each
refusal is one ValueError line (the tool loop hands it to the model)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from palestra.config import build_component
from palestra.errors import ConfigError
from palestra.plugin_manager import get_registry
from palestra.testing import check_tool
from palestra.tools import Tool

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def calc() -> Tool:
    tool = build_component("tool", {"name": "calculator"}, path="tools.tools[0]")
    assert isinstance(tool, Tool)
    return tool


def run(tool: Tool, expression: str) -> str:
    assert tool.argument_error({"expression": expression}) is None
    return str(tool.fn(expression=expression))


def test_it_is_registered_with_a_schema_from_its_docstring_and_keeps_the_contract(calc: Tool) -> None:
    reg = get_registry().get("tool", "calculator")
    assert reg.distribution == "palestra"
    assert calc.name == "calculator" and calc.timeout_s == 5.0
    prop = calc.parameters["properties"]["expression"]
    assert prop["type"] == "string" and "parentheses" in prop["description"]
    assert calc.parameters["required"] == ["expression"]
    check_tool("calculator", examples=[{"expression": "123 * 45"}, {"expression": "(1 + 2) / 4"}])


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123 * 45", "5535"),
        ("417 + 902 + 356 + 781", "2456"),
        ("12 / 2", "6"),  # exact: an int, not "6.0"
        ("1 / 3", "0.3333333333"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** -1", "0.5"),
        ("-2 ** 4", "-16"),
        ("(-2) ** 3", "-8"),
        ("17 // 5", "3"),
        ("-17 % 5", "3"),
        ("+(3)", "3"),
        ("2 ** 99", "633825300114114700748351602688"),  # 30 digits: the default limit
        ("10 ** 29", "1" + "0" * 29),
        ("  7 * (6)  ", "42"),
        ("1e10 * 3", "30000000000"),
        ("2 ** 0.5", "1.414213562"),
    ],
)
def test_arithmetic_is_exact_and_rendered_plainly(calc: Tool, expression: str, value: str) -> None:
    assert run(calc, expression) == value


@pytest.mark.parametrize(
    ("expression", "line"),
    [
        ("__import__('os').system('touch pwned')", "not a function call"),
        ("os.system", "not an attribute"),
        ("x + 1", "not a name"),
        ("(1).__class__", "not an attribute"),
        ("[1, 2][0]", "not an index"),
        ("1 < 2", "not a comparison"),
        ("lambda: 1", "not a lambda"),
        ("1 << 3", "not BinOp"),
        ("'a' * 3", "numbers only, not 'a'"),
        ("True + 1", "numbers only, not True"),
        ("1j * 2", "numbers only, not 1j"),
        ("1 +", "not an arithmetic expression (invalid syntax"),
        ("import os", "not an arithmetic expression (invalid syntax"),
        ("1 / 0", "division by zero (1 / 0)"),
        ("5 // 0", "division by zero (5 // 0)"),
        ("5 % 0.0", "division by zero (5 % 0)"),
        ("0 ** -1", "division by zero (0 ** -1)"),
        ("10 ** 400", "10**400 would have about 401 digits; the calculator stops at 30"),
        ("10 ** 30", "10**30 would have about 31 digits; the calculator stops at 30"),
        ("10.0 ** 400", "10**400 would have about 401 digits"),
        ("0.5 ** -1000", "0.5**-1000 would have about 302 digits"),
        ("1" * 31, "the number has more than 30 digits"),
        ("99999999999999999999 * 99999999999999999999", "the result of * has more than 30 digits"),
        ("1e400", "the number is not a finite number"),
        ("(-8) ** 0.5", "the result of ** is not a real number"),
    ],
)
def test_anything_but_bounded_arithmetic_is_one_line_refusal(calc: Tool, expression: str, line: str) -> None:
    with pytest.raises(ValueError, match=re.escape(line)) as info:
        run(calc, expression)
    message = str(info.value)
    assert line in message and "\n" not in message, message


def test_a_tower_of_powers_is_refused_from_its_size_before_it_is_computed(calc: Tool) -> None:
    # 9**9**9 = 9**387420489: the message's digit count comes from the estimate made instead of computing it
    with pytest.raises(ValueError, match=r"^9\*\*387420489 would have about 369693100 digits; the calculator stops"):
        run(calc, "9 ** 9 ** 9")
    with pytest.raises(ValueError, match=r"^9\*\*387420489 would have about"):  # the inner tower is refused first
        run(calc, "9 ** 9 ** 9 ** 9")
    with pytest.raises(ValueError, match=r"^1.5\*\*1e\+29 would have about 1.76e\+28 digits"):
        run(calc, "1.5 ** 1e29")


def test_names_are_never_evaluated(calc: Tool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for attack in (
        "__import__('os').system('touch pwned')",
        "open('pwned', 'w').write('x')",
        "(lambda: __import__('pathlib').Path('pwned').touch())()",
    ):
        with pytest.raises(ValueError, match=r"only, not a function call$"):
            run(calc, attack)
    assert list(tmp_path.iterdir()) == []


def test_a_long_or_deep_expression_is_refused_in_one_line(calc: Tool) -> None:
    with pytest.raises(
        ValueError, match=r"^the expression is 100001 characters long; the calculator takes at most 1000$"
    ):
        run(calc, "1+" * 50_000 + "1")
    with pytest.raises(ValueError, match=r"too many nested parentheses|nests too deeply"):
        run(calc, "(" * 400 + "1" + ")" * 400)
    with pytest.raises(ValueError, match=r"^the expression nests too deeply$"):
        run(calc, "-" * 999 + "1")
    assert run(calc, "+".join(["1"] * 400)) == "400"  # long but within the limit


def test_deep_nesting_is_refused_whatever_the_recursion_limit(calc: Tool) -> None:
    # torch's compiler and other libraries raise the interpreter's limit; the refusal must not depend on it
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        with pytest.raises(ValueError, match=r"^the expression nests too deeply$"):
            run(calc, "-" * 999 + "1")
        assert run(calc, "+".join(["1"] * 500)) == "500"
    finally:
        sys.setrecursionlimit(before)


def test_options_bound_digits_and_length_and_are_checked_like_a_config() -> None:
    small = build_component(
        "tool", {"name": "calculator", "options": {"max_digits": 4, "max_length": 20, "timeout_s": 1.5}}, path="t"
    )
    assert small.timeout_s == 1.5
    assert small.fn(expression="99 * 99") == "9801"
    with pytest.raises(ValueError, match="the result of \\* has more than 4 digits"):
        small.fn(expression="100 * 100")
    with pytest.raises(ValueError, match="takes at most 20"):
        small.fn(expression="1 + " * 10 + "1")
    with pytest.raises(ConfigError, match=r"tools\.tools\[0\]\.options\.max_digits"):
        build_component("tool", {"name": "calculator", "options": {"max_digits": 0}}, path="tools.tools[0]")


def test_the_schema_refuses_a_non_string_expression(calc: Tool) -> None:
    assert calc.argument_error({"expression": 12}) == "argument 'expression': 12 is not of type 'string'"
    assert calc.argument_error({}) == "'expression' is a required property"
