"""The tool-use metrics of a batch of episodes, read from the turn records :class:`ToolUseEnvironment` writes."""

from __future__ import annotations

from collections.abc import Sequence

from palestra.tools.runner import ERROR_KINDS
from palestra.types import Episode

__all__ = ["tool_metrics"]


def tool_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """``tools/calls_per_episode``, ``tools/error_rate`` (errors / calls; 0 without calls) and
    ``tools/error_rate/<kind>`` for every kind (always present, so the logged keys are stable), ``tools/latency_s``
    (mean per call) and ``tools/answered`` (the share of episodes whose last turn answered and that the driver did
    not cut short)."""
    calls = [c for ep in episodes for t in ep.turns for c in t.info.get("tool_calls", ())]
    n_calls = len(calls)
    errors = [c.get("error") for c in calls if c.get("error")]
    metrics = {
        "tools/calls_per_episode": n_calls / max(1, len(episodes)),
        "tools/error_rate": len(errors) / n_calls if n_calls else 0.0,
        **{f"tools/error_rate/{k}": (errors.count(k) / n_calls if n_calls else 0.0) for k in ERROR_KINDS},
        "tools/latency_s": sum(float(c.get("latency_s", 0.0)) for c in calls) / n_calls if n_calls else 0.0,
    }
    answered = [bool(ep.turns and ep.last.info.get("answered")) and not ep.truncated for ep in episodes]
    metrics["tools/answered"] = sum(answered) / max(1, len(episodes))
    return metrics
