"""Built-in agents (the ``agent:`` section; docs/environments.md) and the ``agent_reward`` reward.

``calculator_agent`` is the word-problem calculator task written as plain ``openai`` client code
(:mod:`palestra.plugins.agents.calculator`). ``agent_reward`` gives a config the reward an agent reported in its
:class:`~palestra.agents.AgentResult` (``reward``), to weight next to the task's own rewards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palestra import hookimpl, option
from palestra.registry import Requires

if TYPE_CHECKING:
    import torch

AGENTS_INSTALL = 'pip install "palestra[agents]"'


def calculator_agent(**options: Any) -> Any:
    from palestra.plugins.agents.calculator import CalculatorAgent

    return CalculatorAgent(**options)


@dataclass
class AgentRewardOptions:
    missing: float = option(0.0)  # the score of an episode whose agent reported no reward (or failed)


class AgentReward:
    """The reward the agent reported for each episode (``AgentResult.reward``); ``missing`` where it reported none."""

    def __init__(self, missing: float = 0.0) -> None:
        self.missing = missing

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        import torch

        scores = []
        for meta in metadata:
            info = meta.get("info")
            value = info.get("agent_reward") if isinstance(info, Mapping) else None
            scores.append(self.missing if value is None else float(value))
        return torch.tensor(scores, dtype=torch.float32)


@hookimpl
def register_agents(register: Any) -> None:
    from palestra.plugins.agents.calculator import CalculatorAgentOptions

    register(
        "calculator_agent",
        Requires(calculator_agent, module="openai", install=AGENTS_INSTALL),
        options=CalculatorAgentOptions,
        description="word problems with a calculator tool, as plain openai client code",
    )


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "agent_reward",
        AgentReward,
        options=AgentRewardOptions,
        description="the reward an agent reported for its episode (AgentResult.reward)",
    )
