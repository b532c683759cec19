"""The environment contract's per-call rules, as pure functions of what one ``reset`` or ``step`` returned.

The rules the trainer itself enforces while it plays (a list of ``batch_size * group_size`` observations, one
``StepResult`` entry per row, finished rows staying finished, known agents) are
:func:`palestra.engine.checked_environment.check_reset` and ``check_step``: the kit applies those very functions
and only names the rule each break falls under. The functions here are the rules the kit adds on top (the rest
of an observation's fields, task groups, ``info`` keys, ``agent_ids`` and ``max_turns``); each returns what is
wrong, or None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from palestra.engine.checked_environment import check_reset, check_step
from palestra.types import Observation, StepResult

__all__ = [
    "agent_ids_problem",
    "group_problem",
    "info_problem",
    "max_turns_problem",
    "observation_fields_problem",
    "reset_problem",
    "step_problem",
]


# ---- the trainer's rules (palestra.engine.checked_environment), with the kit's name for each ------------------
def reset_problem(out: Any, batch_size: int, group_size: int, agent_ids: Sequence[str]) -> tuple[str, str] | None:
    """``(rule, what is wrong)`` when ``reset``'s output breaks the trainer's rules, else None."""
    broken = check_reset(out, batch_size, group_size, agents=agent_ids)
    if broken is None:
        return None
    counted = isinstance(out, (list, tuple)) and len(out) == batch_size * group_size
    return ("observations" if counted else "one observation per row"), broken


def step_problem(
    out: Any, actions: Sequence[str | None], live: Sequence[bool], agent_ids: Sequence[str]
) -> tuple[str, str] | None:
    """``(rule, what is wrong)`` when ``step``'s output breaks the trainer's rules, else None."""
    broken = check_step(out, actions, live, agents=agent_ids)
    if broken is None:
        return None
    if not isinstance(out, StepResult) or len(out.observations) != len(live):
        return "one result per row", broken
    if any(obs is not None and not running for obs, running in zip(out.observations, live)):
        return "done rows stay done", broken
    if any(not isinstance(info, dict) for info in out.info):
        return "info by agent", broken
    return "observations", broken


# ---- the kit's own rules ------------------------------------------------------------------------------------
def agent_ids_problem(agent_ids: Any) -> str | None:
    if not isinstance(agent_ids, tuple) or not agent_ids:
        return f"agent_ids is {agent_ids!r}; expected a non-empty tuple of agent names"
    if not all(isinstance(a, str) and a for a in agent_ids):
        return f"agent_ids {agent_ids!r} holds something that is not a non-empty string"
    if len(set(agent_ids)) != len(agent_ids):
        return f"agent_ids {agent_ids!r} names an agent twice"
    return None


def max_turns_problem(max_turns: Any) -> str | None:
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        return f"max_turns is {max_turns!r}; expected a positive int (1 for a single-turn task)"
    return None


def observation_fields_problem(obs: Observation, row: int) -> str | None:
    """What is wrong with an observation's other fields (the trainer checks its type, prompt and agent), or None."""
    if not isinstance(obs.metadata, dict):
        return f"row {row}: metadata is {type(obs.metadata).__name__}; expected dict"
    if obs.token_ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in obs.token_ids):
        return f"row {row}: token_ids must be a list of ints"
    if obs.stop is not None and not all(isinstance(s, str) and s for s in obs.stop):
        return f"row {row}: stop must be a list of non-empty strings, got {obs.stop!r}"
    cap = obs.max_new_tokens
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        return f"row {row}: max_new_tokens must be None or an int >= 0, got {cap!r}"
    return None


def group_problem(observations: Sequence[Observation], group_size: int) -> str | None:
    """Rows ``[g * G, (g + 1) * G)`` must share one task: the same prompt and metadata."""
    for start in range(0, len(observations), group_size):
        first = observations[start]
        for row in range(start + 1, start + group_size):
            other = observations[row]
            if other.prompt != first.prompt or other.metadata != first.metadata:
                what = "prompt" if other.prompt != first.prompt else "metadata"
                return f"rows {start} and {row} are in one group (group_size={group_size}) but their {what} differs"
    return None


def info_problem(info: dict[str, Any], row: int, agent_ids: Sequence[str]) -> str | None:
    """``info[row]`` maps agent ids of ``agent_ids`` to dicts."""
    for agent, entry in info.items():
        if agent not in agent_ids:
            return f"info[{row}] has an entry for {agent!r}, which is not one of agent_ids {tuple(agent_ids)!r}"
        if not isinstance(entry, dict):
            return f"info[{row}][{agent!r}] is {type(entry).__name__}; expected a dict"
    return None
