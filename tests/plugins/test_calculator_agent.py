"""The built-in `calculator_agent` (plugins/agents/calculator.py) against the real endpoint, with a scripted policy:
its calls run on Palestra's calculator and come back as tool messages with their ids, a broken call is an error
message the model reads, it stops at max_turns, and the tool_format, correctness and agent_reward rewards score its
episodes as they score the built-in tool loop's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from palestra.agents.bridge import AgentEnvironment
from palestra.agents.server import AgentServer
from palestra.config import build_component
from palestra.engine.rollout import run_episodes
from palestra.multiagent.credit import reward_rows
from palestra.plugins.envs.arithmetic import ArithmeticEnv
from palestra.plugins.tools.parsers import HermesParser
from palestra.types import Episode, Observation


def call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


@pytest.fixture
def episodes() -> Iterator[Callable[..., list[Episode]]]:
    made: list[AgentEnvironment] = []

    def play(script: Callable[[Observation], str], **options: Any) -> list[Episode]:
        agent = build_component("agent", {"name": "calculator_agent", "options": options}, path="agent")
        env = AgentEnvironment(ArithmeticEnv(difficulty=1, terms=2, operations=["+"], prompt="{question} ="), agent,
                               AgentServer(), HermesParser(), max_turns=4, request_timeout_s=30)  # fmt: skip
        made.append(env)
        return run_episodes(env, lambda obs: [script(o) for o in obs], 2, seed=0)

    yield play
    for env in made:
        env.close()


def answer_from_result(obs: Observation) -> str:
    """Calls the calculator on the task's question, then answers with what the tool said."""
    if obs.turn == 0:
        return call(obs.metadata["question"])
    messages = obs.messages or []
    return f"<answer>{messages[-1].content}</answer>"


def test_the_calculator_agent_calls_the_tool_and_answers(episodes: Callable[..., list[Episode]]) -> None:
    played = episodes(answer_from_result, system_prompt="Use the calculator.")
    for ep in played:
        first, last = ep.turns[0].observation, ep.turns[-1].observation
        assert (first.messages or [])[0].role == "system" and (first.messages or [])[0].content == "Use the calculator."
        assert first.tools is not None and first.tools[0]["function"]["name"] == "calculator"
        assert [m.role for m in (last.messages or [])][-2:] == ["assistant", "tool"]
        assert ep.last.info["answered"] and ep.last.info["agent_requests"] == 2
    _, completions, metadata = reward_rows(played)
    correctness = build_component("reward", {"name": "correctness"}, path="reward")
    tool_format = build_component("reward", {"name": "tool_format"}, path="reward")
    assert correctness(["", ""], completions, metadata).scores.tolist() == [1.0, 1.0]
    assert tool_format(["", ""], completions, metadata).scores.tolist() == [1.0, 1.0]
    assert [len(m["tool_calls"]) for m in metadata] == [1, 1] and metadata[0]["tool_calls"][0]["error"] is None


def test_a_broken_call_is_an_error_the_model_reads(episodes: Callable[..., list[Episode]]) -> None:
    def script(obs: Observation) -> str:
        return call("2 +* 3") if obs.turn == 0 else "<answer>0</answer>"

    played = episodes(script)
    tool = (played[0].last.observation.messages or [])[-1]
    assert tool.role == "tool" and tool.content.startswith("error: 'calculator' raised ValueError: not an arithmetic")
    metadata = reward_rows(played)[2]
    assert metadata[0]["tool_calls"][0]["error"] == "raised"
    tool_format = build_component("reward", {"name": "tool_format"}, path="reward")
    assert tool_format([""] * 2, ["x"] * 2, metadata).scores.tolist() == [0.5, 0.5]


def test_a_call_the_endpoint_could_not_read_is_answered_as_the_built_in_loop_does(
    episodes: Callable[..., list[Episode]],
) -> None:
    broken = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}</tool_call>'
    played = episodes(lambda obs: broken if obs.turn == 0 else "<answer>2</answer>")
    last = played[0].last.observation.messages or []
    assert [(m.role, m.content) for m in last[-2:-1]] == [("assistant", broken)]  # the exact text, echoed
    assert last[-1].role == "tool" and last[-1].content.startswith("error: the call is not valid JSON")
    metadata = reward_rows(played)[2]
    assert metadata[0]["tool_calls"][0]["error"] == "malformed" and played[0].last.info["answered"]


def test_the_agent_stops_at_max_turns_unanswered(episodes: Callable[..., list[Episode]]) -> None:
    played = episodes(lambda obs: call("1 + 1"), max_turns=2)
    for ep in played:
        assert len(ep.turns) == 2 and ep.last.info["agent_answer"] == "" and not ep.last.info["answered"]
        assert ep.last.info["agent_metadata"]["out_of_turns"] is True


def test_agent_reward_gives_the_reported_reward_and_the_default_for_none() -> None:
    reward = build_component("reward", {"name": "agent_reward", "options": {"missing": -1.0}}, path="reward")
    metadata = [{"info": {"agent_reward": 0.25}}, {"info": {"agent_reward": None}}, {}]
    assert reward(["", "", ""], ["", "", ""], metadata).scores.tolist() == [0.25, -1.0, -1.0]


def test_the_contract_kit_passes_the_calculator_agent() -> None:
    from palestra.testing import check

    check("agent", "calculator_agent", {"max_turns": 2})


class _SyncAgent:
    def rollout(self, client: Any, task: Any) -> str:
        return "42"


class _NumberAgent:
    async def rollout(self, client: Any, task: Any) -> int:
        await client.chat.completions.create(model=task.model, messages=list(task.messages))
        return 42


class _SilentAgent:
    async def rollout(self, client: Any, task: Any) -> str:
        return "42"


@pytest.mark.parametrize(
    "factory, line",
    [
        (_SyncAgent, "agent '_SyncAgent'.rollout: rule 'async rollout': _SyncAgent.rollout is not async"),
        (_NumberAgent, "agent '_NumberAgent'.rollout: rule 'returns an answer': rollout must return an AgentResult "
                       "or a str, got int"),
        (_SilentAgent, "agent '_SilentAgent'.rollout: rule 'asks the policy': it returned without a request"),
    ],
)  # fmt: skip
def test_the_contract_kit_names_the_broken_rule(factory: Any, line: str) -> None:
    from palestra.testing import ContractError, check_agent

    with pytest.raises(ContractError) as caught:
        check_agent(factory)
    assert str(caught.value).startswith(line)


def test_the_environment_contract_holds_for_the_agent_environment() -> None:
    """check_environment on the agent's episodes (several instances, each with its own endpoint, played in lock step):
    same seed, same tasks and steps, groups, one-row and empty batches, and the rewards score its rows."""
    from palestra.testing import check_environment

    made: list[AgentEnvironment] = []

    def make() -> AgentEnvironment:
        agent = build_component("agent", {"name": "calculator_agent", "options": {"max_turns": 2}}, path="agent")
        env = AgentEnvironment(ArithmeticEnv(difficulty=1, terms=2, operations=["+"], prompt="{question} ="), agent,
                               AgentServer(), HermesParser(), max_turns=3, request_timeout_s=30)  # fmt: skip
        made.append(env)
        return env

    try:
        check_environment(make, reward="correctness", reward_options={"tag": None})
    finally:
        for env in made:
            env.close()
