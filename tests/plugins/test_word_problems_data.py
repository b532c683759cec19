"""examples/data/word_problems.jsonl (the SmolLM2 calculator example's data): it is what its script writes, every
answer is right, the held-out split the example uses holds both kinds, and the correctness reward scores it."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from typing import Any

import pytest

from palestra.plugins.envs.dataset import DatasetEnv
from palestra.plugins.rewards.basic import CorrectnessReward
from palestra.plugins.tools.parsers import HermesParser

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "word_problems.jsonl"
SCRIPT = REPO / "examples" / "data" / "make_word_problems.py"


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]


def numbers(question: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", question)]


def test_the_file_is_what_its_script_writes(rows: list[dict[str, Any]]) -> None:
    script = runpy.run_path(str(SCRIPT))
    assert rows == script["rows"]()


def test_every_answer_is_the_product_or_the_sum_of_the_question_numbers(rows: list[dict[str, Any]]) -> None:
    kinds = {"product": 0, "sum": 0}
    for row in rows:
        question = row["messages"][-1]["content"]
        assert row["messages_no_tool"][-1]["content"] == f"{question} Give the final answer as <answer>N</answer>."
        found = numbers(question)
        if row["kind"] == "product":
            a, b = found
            assert 100 <= a <= 999 and 10 <= b <= 99
            assert row["answer"] == a * b
        else:
            assert len(found) == 4 and all(100 <= n <= 999 for n in found)
            assert row["answer"] == sum(found)
        kinds[row["kind"]] += 1
    assert kinds == {"product": 200, "sum": 200}
    assert len({row["messages"][-1]["content"] for row in rows}) == len(rows)  # no question in both splits


def test_the_worked_calls_parse_and_their_results_are_right(rows: list[dict[str, Any]]) -> None:
    shown = rows[0]["messages"][:-1]
    assert all(row["messages"][:-1] == shown for row in rows)  # the same two worked problems in every chat
    calls = [m for m in shown if m["role"] == "assistant" and "<tool_call>" in m["content"]]
    results = [m["content"] for m in shown if m["role"] == "tool"]
    assert len(calls) == len(results) == 2
    for message, result, question in zip(calls, results, [m for m in shown if m["role"] == "user"]):
        turn = HermesParser().parse(message["content"])
        assert not turn.errors and [c.name for c in turn.calls] == ["calculator"]
        expression = turn.calls[0].arguments["expression"]
        terms = numbers(expression)
        assert terms == numbers(question["content"])  # the expression uses the question's numbers
        value = terms[0] * terms[1] if "*" in expression else sum(terms)
        assert result == str(value)


def test_the_held_out_split_of_the_example_holds_both_kinds_and_is_scored_right() -> None:
    env = DatasetEnv(
        path=str(DATA), messages_column="messages", metadata_columns=["kind"], eval_size=40, stop=["</answer>"]
    )
    held = env.held_out()
    observations = held.reset(40, seed=0)
    assert len({o.metadata["row"] for o in observations}) == 40
    assert {o.metadata["kind"] for o in observations} == {"product", "sum"}
    train_rows = {o.metadata["row"] for o in env.reset(360, seed=0)}
    assert not train_rows & {o.metadata["row"] for o in observations}
    reward = CorrectnessReward()
    metadata = [o.metadata for o in observations]
    right = [f"<answer>{m['answer']}</answer>" for m in metadata]
    off_by_one = [f"<answer>{int(m['answer']) + 1}</answer>" for m in metadata]
    grouped = [f"<answer>{int(m['answer']):,}</answer>" for m in metadata]  # 49,740 is 49740
    assert reward([""] * 40, right, metadata).tolist() == [1.0] * 40
    assert reward([""] * 40, grouped, metadata).tolist() == [1.0] * 40
    assert reward([""] * 40, off_by_one, metadata).tolist() == [0.0] * 40
