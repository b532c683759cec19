"""The checked reward call (bad outputs -> one-line errors naming reward and row) and the combinators."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from palestra.checked_reward import CheckedReward, RewardError
from palestra.config import build_component, load_config
from palestra.plugin_manager import get_registry
from palestra.plugins.rewards.combinators import Layered, WeightedSum
from palestra.registry import Registration, Registry
from palestra.types import RewardOutput

PROMPTS = ["q0", "q1", "q2", "q3"]
META = [{"answer": "4"}, {"answer": "5"}, {"answer": "6"}, {"answer": "7"}]


def answer(text: str) -> str:
    return f"<answer>{text}</answer>"


# ---- test-only rewards, registered next to the built-ins ---------------------------------------------
def fixed(values: Any) -> Callable[..., Any]:
    """A reward factory whose reward returns ``values`` whatever it is asked."""
    return lambda: lambda prompts, completions, metadata: values


class Boom:
    """Raises on completions containing 'boom' (also when called one row at a time)."""

    def __call__(self, prompts: Any, completions: list[str], metadata: Any) -> torch.Tensor:
        if any("boom" in c for c in completions):
            raise ZeroDivisionError("division by zero")
        return torch.ones(len(completions))


class Counter:
    """A stateful reward: scores the number of calls so far; raises on 'boom'."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompts: Any, completions: list[str], metadata: Any) -> torch.Tensor:
        self.calls += 1
        if any("boom" in c for c in completions):
            raise ValueError("boom")
        return torch.full((len(completions),), float(self.calls))

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = state["calls"]


def make_registry() -> Registry:
    registry = Registry()
    for reg in get_registry():
        registry.add(reg)
    extra = {
        "nan": fixed(torch.tensor([0.0, float("nan"), 1.0, 1.0])),
        "inf_list": fixed([1.0, 1.0, 1.0, math.inf]),
        "short": fixed(torch.zeros(3)),
        "column": fixed(torch.zeros(4, 1)),
        "words": fixed(["good", "bad", "ok", "fine"]),
        "text": fixed("great"),
        "complex": fixed(torch.zeros(4, dtype=torch.complex64)),
        "numpy": fixed(np.array([1, 0, 1, 0], dtype=np.int64)),
        "bools": fixed(torch.tensor([True, False, True, False])),
        "bad_metric": fixed(RewardOutput(torch.zeros(4), metrics={"drift": float("nan")})),
        "bad_component": fixed(RewardOutput(torch.zeros(4), components={"part": torch.zeros(2)})),
        "boom": Boom,
        "counter": Counter,
    }
    for name, factory in extra.items():
        registry.add(Registration("reward", name, factory, None, "", "tests", None))
    return registry


REGISTRY = make_registry()


def build(node: dict[str, Any], path: str = "reward") -> CheckedReward:
    return build_component("reward", node, path=path, registry=REGISTRY)


def reward_error(reward: CheckedReward, completions: list[str]) -> str:
    with pytest.raises(RewardError) as info:
        reward(PROMPTS[: len(completions)], completions, META[: len(completions)])
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ---- the checked call --------------------------------------------------------------------------------
COMPLETIONS = ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("nan", "reward 'nan': output row 1 is nan (not finite; completion 'b')"),
        ("inf_list", "reward 'inf_list': output row 3 is inf (not finite; completion 'd')"),
        ("short", "reward 'short': output has shape [3], expected [4] (one score per row)"),
        ("column", "reward 'column': output has shape [4, 1], expected [4] (one score per row)"),
        ("words", "reward 'words': output row 0 is 'good' (str), not a number"),
        ("text", "reward 'text': output is str, expected a float tensor of shape [4]"),
        ("complex", "reward 'complex': output has dtype torch.complex64, expected real numbers"),
        ("bad_metric", "reward 'bad_metric': metric 'drift' is nan, expected a finite number"),
        ("bad_component", "reward 'bad_component': component 'part' has shape [2], expected [4] (one score per row)"),
    ],
)
def test_bad_outputs_name_the_reward_and_the_row(name: str, expected: str) -> None:
    assert reward_error(build({"name": name}, path=name), COMPLETIONS) == expected


def test_an_exception_names_the_reward_path_and_the_row() -> None:
    reward = build({"name": "boom"})
    msg = reward_error(reward, ["fine", "ok", "boom!", "boom again"])
    assert msg == "reward 'boom' (reward) raised on row 2 (completion 'boom!'): ZeroDivisionError: division by zero"


def test_a_failing_nested_reward_is_named_by_its_config_path() -> None:
    reward = build({"name": "weighted_sum", "options": {"components": [{"name": "format"}, {"name": "nan"}]}})
    msg = reward_error(reward, COMPLETIONS)
    assert msg == "reward 'nan' (reward.options.components[1]): output row 1 is nan (not finite; completion 'b')"
    reward = build({"name": "layered", "options": {"layers": [{"name": "boom"}]}})
    assert reward_error(reward, ["x", "boom"]).startswith("reward 'boom' (reward.options.layers[0]) raised on row 1")


def test_missing_metadata_is_reported_with_its_row() -> None:
    reward = build({"name": "correctness"})
    with pytest.raises(RewardError) as info:
        reward(["p", "p"], [answer("4"), answer("5")], [{"answer": "4"}, {"solution": "5"}])
    assert str(info.value) == (
        "reward 'correctness' (reward) raised on row 1 (completion '<answer>5</answer>'): "
        "KeyError: \"metadata has no 'answer' (the expected answer); it has ['solution']\""
    )


def test_locating_the_failing_row_leaves_a_stateful_reward_as_it_was() -> None:
    reward = build({"name": "counter"})
    assert reward(PROMPTS[:2], ["a", "b"], META[:2]).scores.tolist() == [1.0, 1.0]
    assert "raised on row 1" in reward_error(reward, ["a", "boom"])
    assert reward.state_dict() == {"calls": 2}  # the batch call counted; the row-by-row search was rolled back


def test_inputs_must_agree_in_length() -> None:
    reward = build({"name": "format"})
    with pytest.raises(RewardError, match=r"got 2 prompts, 3 completions and 3 metadata rows"):
        reward(["a", "b"], ["x", "y", "z"], [{}, {}, {}])
    with pytest.raises(RewardError, match=r"completion 1 is int, expected str"):
        reward(["a", "b"], ["x", 5], [{}, {}])  # type: ignore[list-item]


def test_valid_outputs_become_float32_tensors() -> None:
    out = build({"name": "numpy"})(PROMPTS, COMPLETIONS, META)
    assert out.scores.dtype == torch.float32 and out.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert build({"name": "bools"})(PROMPTS, COMPLETIONS, META).scores.tolist() == [1.0, 0.0, 1.0, 0.0]


# ---- weighted sum ------------------------------------------------------------------------------------
def test_weighted_sum_totals_and_reports_every_term() -> None:
    reward = build(
        {
            "name": "weighted_sum",
            "options": {
                "components": [
                    {"name": "format", "weight": 0.4, "label": "fluency"},
                    {"name": "correctness", "weight": 0.4, "label": "accuracy"},
                    {"name": "length", "weight": 0.2, "label": "politeness", "options": {"target": 2}},
                ]
            },
        }
    )
    completions = [answer("4"), answer("3") + " thanks friend", "4", answer("7") + answer("7")]
    out = reward(PROMPTS, completions, META)
    fluency = [1.0, 1.0, 0.0, 0.0]
    accuracy = [1.0, 0.0, 0.0, 1.0]  # correctness reads the last tag
    politeness = [0.5, 0.5, 0.5, 0.5]  # 1, 3, 1 and 1 words against a target of 2
    assert set(out.components) == {"fluency", "accuracy", "politeness"}
    assert out.components["fluency"].tolist() == fluency
    assert out.components["accuracy"].tolist() == accuracy
    assert out.components["politeness"].tolist() == politeness
    expected = [0.4 * f + 0.4 * a + 0.2 * p for f, a, p in zip(fluency, accuracy, politeness)]
    assert out.scores.tolist() == pytest.approx(expected)


def test_weighted_sum_normalizes_and_nests() -> None:
    reward = build(
        {
            "name": "weighted_sum",
            "options": {
                "normalize": True,
                "components": [
                    {"name": "format", "weight": 3.0},
                    {
                        "name": "weighted_sum",
                        "label": "inner",
                        "weight": -1.0,
                        "options": {"components": [{"name": "correctness", "weight": 2.0}]},
                    },
                ],
            },
        }
    )
    out = reward(PROMPTS[:2], [answer("4"), answer("9")], META[:2])
    assert out.components["inner/correctness"].tolist() == [1.0, 0.0]
    assert out.components["inner"].tolist() == [2.0, 0.0]
    assert out.scores.tolist() == pytest.approx([(3 * 1 - 1 * 2) / 4, (3 * 1 - 0) / 4])


def test_weighted_sum_in_python() -> None:
    reward = WeightedSum(components=[{"name": "format", "weight": 2.0}])
    assert reward(["p"], [answer("1")], [{}]).scores.tolist() == [2.0]


# ---- layered curriculum ------------------------------------------------------------------------------
def layered(**options: Any) -> CheckedReward:
    layers = options.pop("layers", [{"name": "format"}, {"name": "correctness", "unlock_at": 0.8}])
    return build({"name": "layered", "options": {"layers": layers, "ema_decay": 0.5, **options}})


def test_layered_unlocks_when_the_moving_average_crosses_the_threshold() -> None:
    reward = layered()
    inner: Layered = reward.reward
    half = [answer("4"), answer("0"), "no tag", "no tag"]  # format 0.5 (and one correct answer)
    right = [answer(m["answer"]) for m in META]  # format 1, correctness 1
    wrong = [answer("0")] * 4  # format 1, correctness 0

    out = reward(PROMPTS, half, META)  # the moving average starts at 0: 0.5 * 0 + 0.5 * 0.5
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 0.0] and set(out.components) == {"format"}
    assert out.metrics == {"format/active": 1.0, "format/ema": 0.25, "correctness/active": 0.0, "active_layers": 1.0}
    out = reward(PROMPTS, right, META)  # ema 0.625 < 0.8: still locked
    assert out.scores.tolist() == [1.0] * 4 and inner.active == ["format"]
    out = reward(PROMPTS, right, META)  # ema 0.8125 >= 0.8: unlocked from the next call on
    assert out.scores.tolist() == [1.0] * 4
    assert out.metrics["correctness/active"] == 1.0 and out.metrics["active_layers"] == 2.0
    assert inner.active == ["format", "correctness"]
    out = reward(PROMPTS, right, META)
    assert out.scores.tolist() == [2.0] * 4 and set(out.components) == {"format", "correctness"}
    assert out.metrics["correctness/ema"] == 0.5 and out.metrics["format/ema"] == pytest.approx(0.90625)
    out = reward(PROMPTS, half, META)  # unlocking is permanent even when the format slips
    assert out.scores.tolist() == [2.0, 1.0, 0.0, 0.0]
    assert reward(PROMPTS, wrong, META).scores.tolist() == [1.0] * 4


def test_layered_can_watch_the_first_layer_and_gate_rows() -> None:
    reward = layered(
        layers=[
            {"name": "format"},
            {"name": "correctness", "unlock_at": 0.5, "weight": 2.0},
            {"name": "length", "unlock_at": 0.5, "options": {"target": 1}},
        ],
        watch="first",
        gate_rows=True,
    )
    inner: Layered = reward.reward
    reward(PROMPTS, [answer("4")] * 4, META)  # format ema 0.5 unlocks both later layers at once
    assert inner.unlocked == [True, True, True]
    # Row 0: format ok and correct; row 1: correct answer twice (format fails, so correctness is gated off).
    out = reward(PROMPTS[:2], [answer("4"), answer("5") + " " + answer("5")], META[:2])
    assert out.components["correctness"].tolist() == [1.0, 1.0]
    assert out.components["length"].tolist() == [1.0, 0.0]  # 1 word; 2 words against a target of 1
    assert out.scores.tolist() == [1.0 + 2.0 * 1.0 + 1.0, 0.0 + 0.0 + 0.0]


def test_layered_state_round_trips_through_a_checkpoint() -> None:
    reward = layered()
    right = [answer(m["answer"]) for m in META]
    half = [answer("4"), answer("0"), "no tag", "no tag"]
    for batch in (half, right, right):
        reward(PROMPTS, batch, META)
    state = json.loads(json.dumps(reward.state_dict()))  # plain data: any checkpoint format can hold it
    assert state["unlocked"] == [True, True] and state["ema"] == [0.8125, None] and state["calls"] == 3

    fresh = layered()
    assert fresh.reward.unlocked == [True, False]
    fresh.load_state_dict(state)
    assert fresh.reward.unlocked == [True, True] and fresh.reward.ema == [0.8125, None]
    a, b = reward(PROMPTS, right, META), fresh(PROMPTS, right, META)
    assert a.scores.tolist() == b.scores.tolist() == [2.0] * 4
    assert a.metrics == b.metrics
    assert reward.state_dict() == fresh.state_dict()

    other = layered(layers=[{"name": "format"}, {"name": "length", "unlock_at": 0.5}])
    with pytest.raises(
        RewardError, match=r"saved for layers \['format', 'correctness'\], this config has \['format', 'length'\]"
    ):
        other.load_state_dict(state)


def test_nested_state_is_saved_too() -> None:
    reward = build({"name": "weighted_sum", "options": {"components": [{"name": "counter"}, {"name": "format"}]}})
    reward(PROMPTS, COMPLETIONS, META)
    reward(PROMPTS, COMPLETIONS, META)
    state = reward.state_dict()
    assert state == {"terms": {"counter": {"calls": 2}, "format": {}}}
    again = build({"name": "weighted_sum", "options": {"components": [{"name": "counter"}, {"name": "format"}]}})
    again.load_state_dict(state)
    assert again(PROMPTS, COMPLETIONS, META).components["counter"].tolist() == [3.0] * 4


def test_the_default_config_reward_is_the_format_then_correctness_curriculum() -> None:
    reward = build_component("reward", load_config().reward, path="reward")
    out = reward(PROMPTS, [answer("4")] * 4, META)
    assert set(out.components) == {"format"} and out.metrics["correctness/active"] == 0.0
