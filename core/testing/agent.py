"""``check_agent``: the agent contract the rollout endpoint relies on (the ``agent:`` section), rule by rule.

An agent is built once per run and plays every episode of it, many at once, on the endpoint's event loop:
``rollout(client, task)`` must be a coroutine function, must talk to the policy through the client it is given, and
must return an :class:`~palestra.agents.AgentResult` or a str. The check plays one sample task against a live
endpoint on 127.0.0.1 whose "policy" answers every request with ``reply``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from palestra.testing.components import subject
from palestra.testing.errors import Contract

__all__ = ["RULES", "check_agent"]

RULES: dict[str, str] = {
    "builds from its options": "the factory builds the agent from the options given",
    "async rollout": "the agent has rollout(client, task), an async function (it runs on the endpoint's event loop)",
    "asks the policy": "rollout sends at least one request through the client it is given",
    "returns an answer": "rollout returns an AgentResult (answer: str, metadata: dict, reward: float or None) or a str",
    "within the timeout": "rollout returns (or asks again) within request_timeout_s of each answer",
}


def check_agent(
    agent: str | Callable[..., Any],
    options: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    reply: str = "<answer>42</answer>",
    request_timeout_s: float = 30.0,
    max_turns: int = 4,
) -> None:
    """Check a registered agent (by name) or a factory against the contract; raise a one-line
    :class:`~palestra.testing.ContractError` at the first broken rule. ``messages`` is the sample task (a user
    question by default); every request is answered with ``reply``."""
    subj = subject("agent", agent, options, name=name)
    c = Contract("agent", subj.label, RULES)
    with c.calling("build", "builds from its options"):
        built = subj.make()
    rollout = getattr(built, "rollout", None)
    c.require(
        inspect.iscoroutinefunction(rollout),
        "rollout",
        "async rollout",
        f"{type(built).__name__}.rollout is {'not async' if callable(rollout) else 'missing'}",
    )
    info = _play(built, messages, reply, request_timeout_s=request_timeout_s, max_turns=max_turns)
    c.require(not info.get("agent_timeout"), "rollout", "within the timeout", f"silent for {request_timeout_s:g} s")
    error = info.get("agent_error")
    if error is not None and error.startswith("TypeError: rollout must return"):
        raise c.fail("rollout", "returns an answer", error.removeprefix("TypeError: "))
    if error is not None and error.startswith("TypeError: AgentResult"):
        raise c.fail("rollout", "returns an answer", error.removeprefix("TypeError: "))
    c.require(error is None, "rollout", "returns an answer", f"raised {error}")
    c.require(info.get("agent_requests", 0) >= 1, "rollout", "asks the policy", "it returned without a request")


def _play(
    agent: Any, messages: Sequence[Mapping[str, Any]] | None, reply: str, *, request_timeout_s: float, max_turns: int
) -> dict[str, Any]:
    """One episode of ``agent`` on the sample task against a live endpoint; the info its last turn ended with."""
    from palestra.agents.bridge import AgentEnvironment
    from palestra.agents.server import AgentServer
    from palestra.engine.rollout import run_episodes
    from palestra.plugins.tools.parsers import HermesParser

    env = AgentEnvironment(
        _SampleTask(list(messages or [{"role": "user", "content": "What is 6 * 7?"}])),
        agent,
        AgentServer(),
        HermesParser(),
        max_turns=max_turns,
        request_timeout_s=request_timeout_s,
    )
    try:
        episodes = run_episodes(env, lambda observations: [reply] * len(observations), 1)
    finally:
        env.close()
    return dict(episodes[0].last.info)


class _SampleTask:
    """A single-turn environment of one task: its messages, with the answer 42 in the metadata."""

    agent_ids: tuple[str, ...] = ("assistant",)
    max_turns = 1

    def __init__(self, messages: list[Mapping[str, Any]]) -> None:
        self.messages = messages

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Any]:
        from palestra.types import Message, Observation

        messages = [Message(str(m["role"]), str(m["content"])) for m in self.messages]
        text = "\n".join(m.content for m in messages)
        return [Observation(text, messages=messages, metadata={"answer": 42}) for _ in range(batch_size * group_size)]

    def step(self, actions: Sequence[str | None]) -> Any:
        from palestra.types import StepResult

        return StepResult([None] * len(actions), [True] * len(actions), [{} for _ in actions])
