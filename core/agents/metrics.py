"""The agent metrics of a batch of episodes, read from the info :class:`AgentEnvironment` puts on each episode's
last turn."""

from __future__ import annotations

from collections.abc import Sequence

from palestra.types import Episode

__all__ = ["agent_metrics"]


def agent_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """``agents/requests_per_episode``, ``agents/error_rate`` (the share of episodes whose agent raised),
    ``agents/timeout_rate`` (the share that went silent past ``agent.request_timeout_s``) and ``agents/latency_s``
    (wall time per episode, mean)."""
    ends = [ep.last.info for ep in episodes if ep.turns and "agent_requests" in ep.last.info]
    n = max(1, len(ends))
    return {
        "agents/requests_per_episode": sum(int(i["agent_requests"]) for i in ends) / n,
        "agents/error_rate": sum(1 for i in ends if i.get("agent_error")) / n,
        "agents/timeout_rate": sum(1 for i in ends if i.get("agent_timeout")) / n,
        "agents/latency_s": sum(float(i.get("agent_latency_s", 0.0)) for i in ends) / n,
    }
