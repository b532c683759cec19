"""The built-in tool_format reward: its formula on tool-use metadata, and inside weighted_sum and layered unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from palestra.config import build_component
from palestra.errors import ConfigError
from palestra.plugins.rewards.tools import ToolFormatReward


def row(errors: list[str | None] | None, answered: bool) -> dict[str, Any]:
    """Reward metadata as the tool loop writes it: one call per entry of ``errors`` (None: the call ran)."""
    meta: dict[str, Any] = {"answer": "5", "info": {"answered": answered, "tool_calls": []}}
    if errors is not None:
        meta["tool_calls"] = [
            {"name": "add", "arguments": {}, "error": e, "latency_s": 0.0, "content": "5"} for e in errors
        ]
    return meta


ROWS = [
    row([None, None], True),  # every call ran, answered: 1
    row([None, "bad_arguments"], True),  # (0.5 * 1/2 + 0.5 * 1) / 1
    row([None, None, None], False),  # out of calls: (0.5 * 1 + 0) / 1
    row(["malformed"], False),  # 0
    row([], True),  # answered without a call: no_call_score
    row([], False),  # neither
    row(None, True),  # no tool loop at all
]


def score(reward: Any, rows: list[dict[str, Any]]) -> list[float]:
    out = reward(["p"] * len(rows), ["c"] * len(rows), rows)
    return (out.scores if hasattr(out, "scores") else out).tolist()


def test_the_formula() -> None:
    assert score(ToolFormatReward(), ROWS) == [1.0, 0.75, 0.5, 0.0, 0.0, 0.0, 0.0]


def test_the_options_weight_the_parts_and_set_the_no_call_score() -> None:
    reward = ToolFormatReward(format_weight=1.0, answer_weight=0.0, no_call_score=1.0)
    assert score(reward, ROWS) == [1.0, 0.5, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_it_works_inside_weighted_sum_and_layered() -> None:
    summed = build_component(
        "reward",
        {"name": "weighted_sum", "options": {"components": [
            {"name": "tool_format", "weight": 2.0}, {"name": "correctness", "weight": 1.0}]}},
        path="reward",
    )  # fmt: skip
    completions = ["<answer>5</answer>"] * len(ROWS)
    out = summed(["p"] * len(ROWS), completions, ROWS)
    assert out.scores.tolist() == [3.0, 2.5, 2.0, 1.0, 1.0, 1.0, 1.0]
    assert out.components["tool_format"].tolist() == [1.0, 0.75, 0.5, 0.0, 0.0, 0.0, 0.0]
    layered = build_component(
        "reward", {"name": "layered", "options": {"layers": [{"name": "tool_format"}]}}, path="reward"
    )
    assert score(layered, ROWS) == [1.0, 0.75, 0.5, 0.0, 0.0, 0.0, 0.0]


def test_zero_weights_are_one_line_naming_the_option() -> None:
    with pytest.raises(ConfigError, match=r"answer_weight.*format_weight \+ answer_weight must be > 0"):
        build_component(
            "reward", {"name": "tool_format", "options": {"format_weight": 0, "answer_weight": 0}}, path="reward"
        )
