"""The tool-use loop (palestra.tools.episode, .runner, .metrics) driven by a scripted model over the arithmetic
environment: every way a call goes wrong becomes a message to the model and a metric, never an exception; and a real
short training run with a `tools:` section logs the tools/* metrics."""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from train_processes import error_line, install_plugin, palestra, write_config

from palestra.engine.rollout import run_episodes
from palestra.errors import ConfigError
from palestra.multiagent.credit import reward_rows
from palestra.plugins.envs.arithmetic import ArithmeticEnv
from palestra.plugins.rewards.basic import CorrectnessReward
from palestra.plugins.tools.parsers import HermesParser
from palestra.tools import Tool
from palestra.tools.episode import ToolUseEnvironment
from palestra.tools.metrics import tool_metrics
from palestra.tools.runner import ERROR_KINDS, ToolRunner
from palestra.types import Episode, Observation

RELEASE = threading.Event()  # the slow tool waits on it; set at the end of its test so no thread outlives the module


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def boom() -> str:
    """Always fails."""
    raise ValueError("the tool broke\nsecond line of the message\n  File 'x.py', line 1")


def slow() -> str:
    """Waits (for the timeout test)."""
    RELEASE.wait(30)
    return "late"


def loud() -> str:
    """Prints 100 MB in 1 MB chunks."""
    chunk = "p" * 1_000_000
    for _ in range(100):
        print(chunk)
        sys.stderr.write(chunk)
    return "done"


def huge() -> str:
    """Returns 100 MB."""
    return "y" * 100_000_000


def tools() -> list[Tool]:
    made = [Tool.from_function(f) for f in (add, boom, loud, huge)]
    return [*made, Tool.from_function(slow, timeout_s=0.2)]


def make_env(max_tool_calls: int = 3, max_result_chars: int = 200) -> ToolUseEnvironment:
    inner = ArithmeticEnv(difficulty=1, terms=2, prompt="{question} =")
    runner = ToolRunner(tools(), max_result_chars=max_result_chars)
    return ToolUseEnvironment(inner, runner, HermesParser(), max_tool_calls=max_tool_calls, system_prompt="Be exact.")


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def scripted(script: Sequence[str]) -> Callable[[list[Observation]], list[str]]:
    """A model that says ``script[turn]`` on each turn (the last entry from then on)."""
    return lambda observations: [script[min(o.turn, len(script) - 1)] for o in observations]


def play(script: Sequence[str], **env: Any) -> tuple[list[Episode], ToolUseEnvironment]:
    environment = make_env(**env)
    return run_episodes(environment, scripted(script), 2, seed=3, group_size=1), environment


def tool_message(episode: Episode, turn: int = 1) -> str:
    messages = episode.turns[turn].observation.messages
    assert messages is not None and messages[-1].role == "tool"
    return messages[-1].content


def test_a_call_then_an_answer_extends_the_prompt_and_reaches_the_reward() -> None:
    episodes, env = play([call("add", a=2, b=3), "<answer>5</answer>"])
    for ep in episodes:
        first, second = ep.turns[0].observation, ep.turns[1].observation
        assert first.tools == env.specs and first.tool_prompt is not None
        assert first.tool_prompt.startswith("Be exact.\n\n") and "<tools>" in first.tool_prompt
        assert second.prompt.startswith(first.prompt + ep.turns[0].completion)  # one sequence: it extends
        assert second.prompt.endswith("<tool_response>\n5\n</tool_response>\n")
        assert [m.role for m in second.messages or []] == ["user", "assistant", "tool"]
        assert second.messages[1].content == ep.turns[0].completion  # type: ignore[index]
        assert second.turn == 1 and second.stop == first.stop and second.metadata == first.metadata
        assert ep.turns[0].info["tool_calls"][0]["name"] == "add" and ep.turns[0].info["tool_calls"][0]["error"] is None
        assert ep.last.info["answered"] is True and "expected" in ep.last.info  # the inner environment's info
        assert not ep.truncated
    metrics = tool_metrics(episodes)
    assert metrics["tools/calls_per_episode"] == 1.0 and metrics["tools/error_rate"] == 0.0
    assert metrics["tools/answered"] == 1.0 and metrics["tools/latency_s"] >= 0.0
    assert set(metrics) == {
        "tools/calls_per_episode", "tools/error_rate", "tools/latency_s", "tools/answered",
        *(f"tools/error_rate/{k}" for k in ERROR_KINDS),
    }  # fmt: skip
    _, _, meta = reward_rows(episodes)
    assert [m["role"] for m in meta[0]["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert meta[0]["messages"][-1]["content"] == "<answer>5</answer>"
    assert meta[0]["tool_calls"] == [
        {"name": "add", "arguments": {"a": 2, "b": 3}, "error": None, "latency_s": pytest.approx(0, abs=5),
         "content": "5"}
    ]  # fmt: skip


BAD_CALLS = {
    "broken-json": ('<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>', "malformed",
                    "error: the call is not valid JSON"),
    "unclosed-tag": ("<tool_call>" + json.dumps({"name": "add", "arguments": {"a": 2}}), "malformed",
                     "error: a <tool_call> tag is never closed"),
    "wrong-type": (call("add", a="two", b=3), "bad_arguments",
                   "error: bad arguments for 'add': argument 'a': 'two' is not of type 'integer'"),
    "unknown-tool": (call("multiply", a=2, b=3), "unknown_tool",
                     "error: there is no tool 'multiply'; the tools are: add, boom, huge, loud, slow"),
    "raises": (call("boom"), "raised", "error: 'boom' raised ValueError: the tool broke"),
}  # fmt: skip


@pytest.mark.parametrize(("action", "kind", "says"), list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_a_bad_call_is_an_error_message_to_the_model_and_a_metric(action: str, kind: str, says: str) -> None:
    episodes, _ = play([action, "<answer>1</answer>"])
    for ep in episodes:
        assert tool_message(ep) == says if kind != "malformed" else tool_message(ep).startswith(says)
        assert ep.turns[0].info["tool_calls"][0]["error"] == kind
        assert ep.last.info["answered"] is True
    metrics = tool_metrics(episodes)
    assert metrics["tools/error_rate"] == 1.0 and metrics[f"tools/error_rate/{kind}"] == 1.0
    assert sum(metrics[f"tools/error_rate/{k}"] for k in ERROR_KINDS) == 1.0


def test_a_tool_that_raises_shows_one_line_and_no_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    episodes, _ = play([call("boom"), "<answer>1</answer>"])
    assert "\n" not in tool_message(episodes[0]) and "second line" not in tool_message(episodes[0])
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "the tool broke" not in out + err


def test_a_tool_past_its_timeout_is_answered_and_abandoned() -> None:
    try:
        episodes, _ = play([call("slow"), "<answer>1</answer>"])
    finally:
        RELEASE.set()
    assert tool_message(episodes[0]) == "error: 'slow' timed out after 0.2 s"
    record = episodes[0].turns[0].info["tool_calls"][0]
    assert record["error"] == "timeout" and record["latency_s"] >= 0.2
    assert tool_metrics(episodes)["tools/error_rate/timeout"] == 1.0


def test_a_tool_that_prints_100_mb_is_captured_and_cut(capfd: pytest.CaptureFixture[str]) -> None:
    tracemalloc.start()
    try:
        episodes, _ = play([call("loud"), "<answer>1</answer>"], max_result_chars=500)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000  # the 200 MB printed were never held: each chunk went into a 500-character buffer
    content = tool_message(episodes[0])
    assert content.startswith("done\n[printed]\npppp") and content.endswith("more characters cut]")
    assert len(content) < 600
    print("the trainer still prints")  # a write from this (not a tool) thread reaches the real stream
    out, err = capfd.readouterr()
    assert out == "the trainer still prints\n" and err == ""


def test_a_tool_that_returns_100_mb_is_cut_with_a_marker() -> None:
    episodes, _ = play([call("huge"), "<answer>1</answer>"])
    content = tool_message(episodes[0])
    assert content == "y" * 200 + "\n[... 99999800 more characters cut]"
    assert len(episodes[0].turns[1].observation.prompt) < 2_000


def test_a_model_that_never_stops_calling_ends_unanswered_at_max_tool_calls() -> None:
    from palestra.plugins.rewards.tools import ToolFormatReward

    episodes, env = play([call("add", a=1, b=1)], max_tool_calls=3)
    assert env.max_turns == 4
    for ep in episodes:
        assert len(ep.turns) == 4 and not ep.truncated
        assert [len(t.info["tool_calls"]) for t in ep.turns] == [1, 1, 1, 0]  # the 4th call is not run
        assert ep.last.info["answered"] is False and ep.last.info["out_of_calls"] is True
    metrics = tool_metrics(episodes)
    assert metrics["tools/answered"] == 0.0 and metrics["tools/calls_per_episode"] == 3.0
    prompts, completions, meta = reward_rows(episodes)
    assert CorrectnessReward()(prompts, completions, meta).tolist() == [0.0, 0.0]  # scored as unanswered
    assert ToolFormatReward()(prompts, completions, meta).tolist() == [0.5, 0.5]  # calls fine, no answer


def test_the_loop_refuses_a_multi_turn_environment() -> None:
    from palestra.plugins.envs.relay import RelayEnv

    inner = RelayEnv()
    runner = ToolRunner(tools(), max_result_chars=100)
    with pytest.raises(
        ConfigError, match=r"^tools: the tool loop wraps a single-turn environment; environment 'relay'"
    ):
        ToolUseEnvironment(inner, runner, HermesParser(), max_tool_calls=2, name="relay")


# ---- a real training run with a `tools:` section -------------------------------------------------------------
PLUGIN = "palestra_tool_loop_plugin"
PLUGIN_SOURCE = textwrap.dedent(
    """
    from dataclasses import dataclass

    from palestra import hookimpl
    from palestra.tools import Tool


    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first addend
            b: the second addend
        \"\"\"
        return a + b


    @dataclass
    class AdderOptions:
        name: str = "add"


    def adder(name="add"):
        return Tool.from_function(add, name=name)


    @hookimpl
    def register_tools(register):
        register("adder", adder, options=AdderOptions, description="adds two integers (a test tool)")
    """
)


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tool plugin above as an installed distribution: the module and a dist-info with its entry point."""
    return install_plugin(tmp_path_factory.mktemp("tool-plugin"), PLUGIN, PLUGIN_SOURCE, "tool_loop")


def tools_section(*tools: dict[str, Any]) -> dict[str, Any]:
    return {"tools": list(tools), "parser": {"name": "hermes"}, "max_tool_calls": 2, "max_result_chars": 64}


def test_a_short_training_run_with_tools_logs_the_tool_metrics(
    tmp_path: Path, plugin_site: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    terms = [{"name": "correctness", "weight": 1.0}, {"name": "tool_format", "weight": 0.5}]
    reward = {"name": "weighted_sum", "options": {"components": terms}}
    raw = raw_config(sections={"tools": tools_section({"name": "adder"}), "reward": reward}, steps=3, save_every=3)
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, site=plugin_site)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "r" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tools/calls_per_episode" in r]
    assert len(steps) == 3
    for r in steps:
        assert {f"tools/error_rate/{k}" for k in ERROR_KINDS} <= set(r)
        assert 0.0 <= r["tools/answered"] <= 1.0 and r["tools/calls_per_episode"] >= 0.0


def test_two_tools_with_one_name_are_one_line_naming_both_entries(
    tmp_path: Path, plugin_site: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(sections={"tools": tools_section({"name": "adder"}, {"name": "adder"})}, steps=1)
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, site=plugin_site)
    assert result.returncode == 2
    assert error_line(result).endswith(
        "tools.tools[1]: a tool named 'add' is already offered by tools.tools[0]; tool names must be unique "
        "(rename one in its options)"
    )
    assert not (tmp_path / "runs" / "r" / "log.jsonl").exists()


def test_tools_around_a_multi_turn_environment_are_one_line_and_write_nothing(
    tmp_path: Path, plugin_site: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(sections={"tools": tools_section({"name": "adder"}), "environment": {"name": "relay"}}, steps=1)
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, site=plugin_site)
    assert result.returncode == 2
    assert error_line(result) == (
        "palestra train: error: tools: the tool loop wraps a single-turn environment; environment 'relay' has "
        "max_turns=3 (give the tools to a single-turn environment)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_config_show_prints_the_tools_section(
    tmp_path: Path, plugin_site: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    import subprocess

    from train_processes import clean_env

    raw = raw_config(sections={"tools": tools_section({"name": "adder", "options": {"name": "plus"}})})
    shown = subprocess.run(
        [sys.executable, "-m", "palestra", "config", "show", str(write_config(tmp_path, raw))],
        env=clean_env(plugin_site), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    section = shown.stdout[shown.stdout.index("\ntools:\n") :]
    assert "  - name: adder\n    options:\n      name: plus\n  parser:\n    name: hermes\n" in section
    assert "  max_tool_calls: 2\n" in section and "  max_result_chars: 64\n" in section


def test_tool_timeouts_that_do_not_fit_the_data_timeout_are_one_line(
    tmp_path: Path, plugin_site: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = raw_config(sections={"tools": {**tools_section({"name": "adder"}), "max_tool_calls": 13}}, steps=1)
    raw["train"]["data_timeout_s"] = 120
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, site=plugin_site)
    assert result.returncode == 2
    assert error_line(result) == (
        "palestra train: error: tools.max_tool_calls: 13 calls of tool 'add' (timeout_s=10) may take 130 s in one "
        "step, not below train.data_timeout_s=120; raise train.data_timeout_s or lower tools.max_tool_calls or the "
        "tool's timeout"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_rows_run_side_by_side_so_a_batch_of_hanging_tools_costs_one_timeout() -> None:
    gate = threading.Event()
    waiting = threading.Barrier(4, timeout=1.5)  # rows in turn: the first breaks it, and "raised"

    def hang() -> str:
        """Waits until every row's call has started: only possible when the rows run side by side."""
        waiting.wait()
        gate.wait(30)
        return "late"

    inner = ArithmeticEnv(difficulty=1, terms=2, prompt="{question} =")
    runner = ToolRunner([Tool.from_function(hang, timeout_s=2.0)], max_result_chars=100)
    env = ToolUseEnvironment(inner, runner, HermesParser(), max_tool_calls=1)
    try:
        episodes = run_episodes(env, scripted([call("hang"), "<answer>1</answer>"]), 2, seed=0, group_size=2)
    finally:
        gate.set()
    assert [tool_message(ep) for ep in episodes] == ["error: 'hang' timed out after 2 s"] * 4


def test_state_and_the_held_out_split_are_forwarded_exactly_when_the_inner_environment_has_them() -> None:
    from palestra.types import HeldOutSplit, Stateful

    class Counting(ArithmeticEnv):
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self.resets = 0

        def state_dict(self) -> dict[str, Any]:
            return {"resets": self.resets}

        def load_state_dict(self, state: Any) -> None:
            self.resets = state["resets"]

        def held_out(self) -> ArithmeticEnv:
            return ArithmeticEnv(difficulty=2)

    runner = ToolRunner(tools(), max_result_chars=100)
    plain = ToolUseEnvironment(ArithmeticEnv(), runner, HermesParser(), max_tool_calls=1)
    assert not isinstance(plain, Stateful) and not isinstance(plain, HeldOutSplit)
    wrapped = ToolUseEnvironment(Counting(), runner, HermesParser(), max_tool_calls=1, system_prompt="Hi.")
    assert isinstance(wrapped, Stateful) and isinstance(wrapped, HeldOutSplit)
    wrapped.load_state_dict({"resets": 7})
    assert wrapped.state_dict() == {"resets": 7} and wrapped.inner.resets == 7  # type: ignore[attr-defined]
    held = wrapped.held_out()
    assert isinstance(held, ToolUseEnvironment) and held.inner.options.difficulty == 2  # type: ignore[attr-defined]
    assert held.tool_prompt == wrapped.tool_prompt and held.max_turns == 2
