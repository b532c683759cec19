"""What an agent plugin is: ``async def rollout(client, task) -> AgentResult | str`` (docs/environments.md).

An agent is ordinary code written against an OpenAI-compatible client (the ``openai`` package's
:class:`openai.AsyncOpenAI`). During a rollout Palestra hands it a client pointed at the policy under training,
served on loopback by :mod:`palestra.agents.server`, and one :class:`AgentTask` (a task of the configured
environment). Every request the agent sends becomes one turn of the episode, sampled by the trainer's own sampler,
so what trains is exactly what the agent was answered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Agent", "AgentResult", "AgentTask"]


@dataclass(frozen=True)
class AgentTask:
    """One episode's task: the environment's first observation, as an agent sees it.

    ``prompt`` is the observation's text and ``messages`` its chat messages (plain ``{"role", "content"}`` dicts; a
    prompt-only environment gives one user message). ``metadata`` is a read-only copy of the episode's metadata
    (the ground truth is there: an agent must not use it to answer). ``model`` is the name to pass as ``model=``;
    ``index`` is the episode's row in the batch.
    """

    prompt: str
    messages: list[dict[str, Any]]
    metadata: Mapping[str, Any]
    model: str
    index: int


@dataclass
class AgentResult:
    """What an agent's rollout returns.

    ``answer`` is the episode's completion as the wrapped environment and the rewards score it. ``metadata`` is
    merged into the episode's metadata that the rewards read; ``reward`` is a reward the agent reports itself, which
    the ``agent_reward`` reward gives to a config that weights it (None: the agent reports none).
    """

    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None


@runtime_checkable
class Agent(Protocol):
    """An agent plugin's component (its factory is registered with ``register_agents``)."""

    async def rollout(self, client: Any, task: AgentTask) -> AgentResult | str:
        """Play ``task`` with ``client`` (an ``openai.AsyncOpenAI`` bound to this episode) and return the answer."""
        ...


def as_result(value: Any) -> AgentResult:
    """An agent's return value as an :class:`AgentResult`; a TypeError (one line) for anything else."""
    if isinstance(value, AgentResult):
        if not isinstance(value.answer, str):
            raise TypeError(f"AgentResult.answer must be a str, got {type(value.answer).__name__}")
        if not isinstance(value.metadata, dict):
            raise TypeError(f"AgentResult.metadata must be a dict, got {type(value.metadata).__name__}")
        if value.reward is not None and not _finite(value.reward):
            raise TypeError(f"AgentResult.reward must be a finite number or None, got {value.reward!r}")
        return value
    if isinstance(value, str):
        return AgentResult(answer=value)
    raise TypeError(f"rollout must return an AgentResult or a str, got {type(value).__name__}")


def _finite(x: Any) -> bool:
    import math

    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
