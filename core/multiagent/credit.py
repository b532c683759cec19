"""Credit assignment: which reward each agent's rows train on (its own turn's, or the team's episode reward)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from palestra.engine.rollout import Rollout, reward_rows
from palestra.types import AgentId, Episode, HeldOutScoring

if TYPE_CHECKING:
    import torch

__all__ = ["credit_rewards"]


def _agent_rows(episodes: Sequence[Episode], agent_id: AgentId) -> tuple[list[int], tuple[list[str], list[str], list[dict[str, Any]]]]:
    """The episodes where ``agent_id`` acted, and their reward rows (that agent's last turn)."""
    picked = [e for e, ep in enumerate(episodes) if ep.by_agent(agent_id)]
    return picked, reward_rows([episodes[e] for e in picked], agent_id)


def credit_rewards(
    reward: Any, rollout: Rollout, agent_ids: Sequence[AgentId], credit: str, team: Any
) -> tuple[dict[AgentId, torch.Tensor] | None, dict[str, float]]:
    """Per-agent rewards: ``(agent_scores, metrics)``.

    ``credit == "role"``: ``agent_scores[a][e]`` is ``reward`` on agent ``a``'s own last turn of episode ``e`` (the
    reward sees ``metadata["agent_id"]``), for :meth:`Rollout.experience`. ``"team"``: None (every row keeps its
    episode's reward). Either way ``metrics`` has ``reward/agent/<a>`` for every agent that acted, its own turn's
    score (with team credit from ``reward.evaluate``: the reward's state, a curriculum's progress, is not
    advanced by metrics). ``team`` is the reward's output on the episodes'
    last turns, reused where an agent's rows are exactly those.
    """
    import torch

    episodes = rollout.episodes
    last = reward_rows(episodes)
    role = credit == "role"
    score = reward.evaluate if not role and isinstance(reward, HeldOutScoring) else reward
    agent_scores: dict[AgentId, torch.Tensor] = {}
    metrics: dict[str, float] = {}
    for a in list(dict.fromkeys([*agent_ids, *(t.agent_id for ep in episodes for t in ep.turns)])):
        picked, rows = _agent_rows(episodes, a)
        if not picked:
            continue
        same = len(picked) == len(episodes) and rows[1] == last[1] and [m["turn"] for m in rows[2]] == [m["turn"] for m in last[2]]
        out = team if (role and same) else score(*rows)
        scores = out.scores.float()
        full = torch.zeros(len(episodes), dtype=torch.float32, device=scores.device)
        full[torch.as_tensor(picked, device=scores.device)] = scores
        agent_scores[a] = full
        metrics[f"reward/agent/{a}"] = float(scores.mean())
    return (agent_scores if role else None), metrics
