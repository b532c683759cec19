"""Answer matching in the ``correctness`` reward (plugins/rewards/basic.py): numbers by value, text normalised,
LaTeX decoration (``\\boxed{...}``, ``$...$``) removed. Table-driven: each row is (given, expected, match)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from palestra.config import build_component
from palestra.plugins.rewards.basic import answers_match, clean_answer, last_boxed, parse_number, parse_value

MATCHES = [
    # numbers: thousands separators, leading/trailing zeros, signs, exponents
    ("1,000", "1000", True),
    ("1,234,567", "1234567", True),
    ("0.50", ".5", True),
    ("-0", "0", True),
    ("+7", "7", True),
    ("7.000", "7", True),
    ("1e3", "1000", True),
    ("2.5E-1", "0.25", True),
    ("12 000", "12000", True),  # a space as thousands separator
    ("1,2", "12", False),  # commas group digits in threes only
    ("1000.1", "1000", False),
    ("-5", "5", False),
    # fractions and decimals are equal by value (exactly: no float rounding)
    ("1/2", "0.5", True),
    ("-3/4", "-0.75", True),
    ("\\frac{1}{3}", "1/3", True),
    ("\\dfrac{2}{4}", "0.5", True),
    ("1/3", "0.3333", False),
    ("0.1", "1/10", True),
    ("1/0", "0", False),
    # LaTeX answers: \boxed{} (nested braces, the last one), $...$, \(...\), \text{}, a trailing period
    ("\\boxed{42}", "42", True),
    ("so \\boxed{1} or rather \\boxed{2}", "2", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("$\\boxed{42}$.", "42", True),
    ("$42$", "42", True),
    ("$$ 42 $$", "42", True),
    ("\\(42\\)", "42", True),
    ("\\boxed{\\text{Paris}}", "paris", True),
    ("\\boxed{x^{2}+{1}}", "x^{2}+{1}", True),
    ("42.", "42", True),
    ("\\boxed{42", "42", False),  # unclosed: not an answer
    # text: case, whitespace and a trailing period or ! do not matter; anything else does
    ("Paris.", "paris", True),
    ("  New   York ", "new york", True),
    ("yes!", "Yes", True),
    ("Tarn", "tam", False),
    ("blue", "blue green", False),
]


@pytest.mark.parametrize(("given", "expected", "match"), MATCHES, ids=[f"{g!r}~{e!r}" for g, e, _ in MATCHES])
def test_answers_match(given: str, expected: str, match: bool) -> None:
    assert answers_match(given, expected) is match


VALUES = [
    (" 1,000. ", Fraction(1000)),
    ("-0.50", Fraction(-1, 2)),
    (".5", Fraction(1, 2)),
    ("3/4", Fraction(3, 4)),
    ("\\boxed{-\\frac{3}{4}}", Fraction(-3, 4)),
    ("1e999999", None),  # too large to hold exactly: not read as a number
    ("12abc", None),
    ("", None),
    (".", None),
    ("-", None),
    ("nan", None),
    ("inf", None),
    ("1,23", None),
]


@pytest.mark.parametrize(("text", "value"), VALUES, ids=[repr(t) for t, _ in VALUES])
def test_parse_value(text: str, value: Fraction | None) -> None:
    assert parse_value(text) == value
    assert parse_number(text) == (None if value is None else float(value))


def test_boxed_and_cleaning() -> None:
    assert last_boxed("a \\boxed{x{y}z} b \\fbox{w}") == "w"
    assert last_boxed("no box") is None and last_boxed("\\boxed{open") is None
    assert clean_answer("  $\\boxed{ \\text{ok} }$. ") == "ok"


def test_modes_and_tolerance() -> None:
    assert answers_match("0.5", "1/2", mode="numeric")
    assert not answers_match("half", "0.5", mode="numeric")
    assert answers_match("1/2", "1/2", mode="text") and not answers_match("0.5", "1/2", mode="text")
    assert answers_match("3.14", "3.14159", tolerance=0.01) and not answers_match("3.1", "3.14159", tolerance=0.01)
    with pytest.raises(ValueError, match=r"^mode is numeric but the expected answer 'Paris' is not a number$"):
        answers_match("Paris", "Paris", mode="numeric")


REWARD_ROWS = [
    ("<answer>1,000</answer>", "1000", 1.0),
    ("<answer>$\\boxed{1000}$</answer>", "1000", 1.0),
    ("<answer>\\frac{1}{2}</answer>", "0.5", 1.0),
    ("<answer>Paris.</answer>", "paris", 1.0),
    ("1000", "1000", 0.0),  # no tag: no answer
    ("<answer>1</answer> then <answer>2</answer>", "2", 1.0),  # the last tag counts
]


def test_the_correctness_reward_uses_the_matching_rules() -> None:
    reward = build_component("reward", {"name": "correctness"}, path="reward")
    completions = [c for c, _, _ in REWARD_ROWS]
    metadata = [{"answer": a} for _, a, _ in REWARD_ROWS]
    out = reward(["p"] * len(completions), completions, metadata)
    assert out.scores.tolist() == [s for _, _, s in REWARD_ROWS]
    whole = build_component("reward", {"name": "correctness", "options": {"tag": None}}, path="reward")
    assert whole(["p", "p"], ["The sum is \\boxed{12}.", "\\boxed{13}"], [{"answer": 12}] * 2).scores.tolist() == [
        1.0,
        0.0,
    ]
