"""Driving an :class:`~palestra.types.Environment` to the end of its episodes, and turning episodes into reward rows.

This is the reference semantics of the environment protocol: the trainer's rollout loop does the same with a
policy as the responder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .types import AgentId, Environment, Episode, Observation, Turn

Responder = Callable[[list[Observation]], Sequence[str]]
"""Given the live rows' observations, return one completion per observation (same order)."""


def run_episodes(
    env: Environment, respond: Responder, batch_size: int, *, seed: int | None = None, group_size: int = 1
) -> list[Episode]:
    """Reset ``env`` and step it until every episode is done or ``env.max_turns`` turns have passed.

    ``respond`` is called once per turn with the observations of the rows still running (it may dispatch on
    ``obs.agent_id`` to play several agents). Returns one :class:`Episode` per row, in row order.
    """
    observations: list[Observation | None] = list(env.reset(batch_size, seed=seed, group_size=group_size))
    n = len(observations)
    if n != batch_size * group_size:
        raise ValueError(f"{type(env).__name__}.reset returned {n} observations for batch_size*group_size={batch_size * group_size}")
    episodes = [Episode(metadata=dict(obs.metadata)) for obs in observations if obs is not None]
    for _ in range(env.max_turns):
        live = [i for i, obs in enumerate(observations) if obs is not None]
        if not live:
            break
        live_obs = [observations[i] for i in live]
        replies = list(respond(live_obs))  # type: ignore[arg-type]
        if len(replies) != len(live):
            raise ValueError(f"the responder returned {len(replies)} completions for {len(live)} observations")
        actions: list[str | None] = [None] * n
        for i, reply in zip(live, replies):
            actions[i] = reply
        result = env.step(actions)
        if len(result.observations) != n:
            raise ValueError(f"{type(env).__name__}.step returned {len(result.observations)} rows, expected {n}")
        for i, reply in zip(live, replies):
            obs = observations[i]
            assert obs is not None
            episodes[i].turns.append(Turn(obs.agent_id, obs, reply, dict(result.info[i].get(obs.agent_id, {}))))
        observations = list(result.observations)
    for i, obs in enumerate(observations):
        if obs is not None:
            episodes[i].truncated = True
    return episodes


def reward_rows(
    episodes: Sequence[Episode], agent_id: AgentId | None = None
) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """``(prompts, completions, metadata)`` for a reward: each episode's last turn (of ``agent_id`` if given).

    Each metadata row is the episode's metadata plus ``agent_id``, ``turn`` and the environment's ``info``
    for that turn, so a reward can score different agents differently.
    """
    prompts: list[str] = []
    completions: list[str] = []
    metadata: list[dict[str, Any]] = []
    for k, ep in enumerate(episodes):
        turns = ep.by_agent(agent_id) if agent_id is not None else ep.turns
        if not turns:
            who = f" by agent {agent_id!r}" if agent_id is not None else ""
            raise ValueError(f"episode {k} has no turn{who} to score")
        turn = turns[-1]
        prompts.append(turn.observation.prompt)
        completions.append(turn.completion)
        metadata.append({**ep.metadata, "agent_id": turn.agent_id, "turn": turn.observation.turn, "info": turn.info})
    return prompts, completions, metadata
