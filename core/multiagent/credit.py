"""Credit assignment: which rows a reward scores, and which score each agent's training rows then get.

One pass, and a reward is called once per step, never per agent: :func:`credit_plan` lists every row the step needs
scored (each episode's last turn, for the team reward and ``reward/mean``; each agent's last turn, for role credit
and the ``reward/agent/<a>`` metrics), each row once; the caller scores ``plan.rows`` with one reward call, and
:meth:`CreditPlan.assign` splits that one output. A stateful reward (a curriculum) therefore advances once per
step whatever the credit mode, and under torchrun, where the caller scores the global batch, identically on every
rank. The two modes score the same rows and differ only in what the training rows receive.

:func:`reward_rows` is what a reward sees of an episode: its last turn (of one agent, if given). The single-agent
case is team credit with one agent, so it lives here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from palestra.types import AgentId, Episode, RewardOutput

if TYPE_CHECKING:
    import torch

__all__ = ["CREDIT_MODES", "CreditPlan", "RewardRows", "credit_plan", "reward_rows"]

CREDIT_MODES = ("team", "role")

RewardRows = tuple[list[str], list[str], list[dict[str, Any]]]
"""``(prompts, completions, metadata)``: the three arguments of a reward call."""


def _row(episode: Episode, turn: int) -> tuple[str, str, dict[str, Any]]:
    """The reward row of ``episode.turns[turn]``: its prompt, its completion, and the episode's metadata plus the
    turn's ``agent_id``, ``turn`` and the environment's ``info`` (so a reward can score agents differently).

    A reward may score the whole trajectory: ``messages`` (the turn's chat messages and its completion as the last
    ``assistant`` message, plain dicts) in a multi-turn or tool-use episode whose observations have messages, and
    ``tool_calls`` (every call up to this
    turn: ``name``, ``arguments``, ``error``, ``latency_s`` and the result ``content``) in a tool-use episode."""
    t = episode.turns[turn]
    # an agent episode (the agent: section) is scored on the agent's answer, with the metadata the agent returned
    agent_meta = t.info.get("agent_metadata")
    meta = {
        **episode.metadata,
        **(agent_meta if isinstance(agent_meta, dict) else {}),
        "agent_id": t.agent_id,
        "turn": t.observation.turn,
        "info": t.info,
    }
    uses_tools = any("tool_calls" in u.info for u in episode.turns)  # a tool-use episode (docs/tools.md)
    # the whole conversation, for a reward over the trajectory; a single-turn row's metadata stays as it was
    if t.observation.messages and (uses_tools or len(episode.turns) > 1):
        meta["messages"] = [m.as_dict() for m in t.observation.messages] + [
            {"role": "assistant", "content": t.completion}
        ]
    if uses_tools:  # every call so far, even none
        meta["tool_calls"] = [dict(c) for u in episode.turns[: turn + 1] for c in u.info.get("tool_calls", ())]
    answer = t.info.get("agent_answer")
    return t.observation.prompt, answer if isinstance(answer, str) else t.completion, meta


def _last_turn(episode: Episode, agent_id: AgentId | None) -> int | None:
    """Index of ``episode``'s last turn (by ``agent_id`` if given); None when there is none."""
    for i in range(len(episode.turns) - 1, -1, -1):
        if agent_id is None or episode.turns[i].agent_id == agent_id:
            return i
    return None


def reward_rows(episodes: Sequence[Episode], agent_id: AgentId | None = None) -> RewardRows:
    """``(prompts, completions, metadata)`` for a reward: each episode's last turn (of ``agent_id`` if given)."""
    prompts: list[str] = []
    completions: list[str] = []
    metadata: list[dict[str, Any]] = []
    for k, ep in enumerate(episodes):
        turn = _last_turn(ep, agent_id)
        if turn is None:
            who = f" by agent {agent_id!r}" if agent_id is not None else ""
            raise ValueError(f"episode {k} has no turn{who} to score")
        prompt, completion, meta = _row(ep, turn)
        prompts.append(prompt)
        completions.append(completion)
        metadata.append(meta)
    return prompts, completions, metadata


@dataclass(frozen=True)
class AgentRows:
    """Where one agent's reward rows are: the episodes it acted in, and its last turn's row in the plan, for each."""

    episodes: list[int]
    rows: list[int]


@dataclass(frozen=True)
class CreditPlan:
    """Every row a step scores, each once, and how one reward output over them is assigned (see the module docstring).

    ``rows[:team_rows]`` are the episodes' last turns in episode order; the agents' own last turns that are not also
    their episode's last turn follow. ``agents`` maps each agent that acted to its rows.
    """

    rows: RewardRows
    team_rows: int
    agents: dict[AgentId, AgentRows] = field(default_factory=dict)
    role: bool = False

    def assign(self, scored: RewardOutput) -> tuple[RewardOutput, dict[AgentId, torch.Tensor] | None, dict[str, float]]:
        """``(team, agent_scores, metrics)`` from ``scored``, the reward's one output on :attr:`rows`.

        ``team``: the output on the episodes' last turns (scores, components; the reward's own metrics whole).
        ``agent_scores``: with role credit, ``agent_scores[a][e]`` is agent ``a``'s own last turn's score in episode
        ``e`` (0 where it did not act), for :meth:`palestra.engine.rollout.Rollout.experience`; None with team
        credit (every row keeps its episode's reward). ``metrics``: ``reward/agent/<a>``, the mean of agent ``a``'s
        own last turns' scores, for every agent that acted.
        """
        import torch

        total = len(self.rows[0])
        if scored.scores.shape[0] != total:
            raise ValueError(
                f"CreditPlan.assign: the reward scored {scored.scores.shape[0]} rows; the plan has {total}"
            )
        n = self.team_rows
        team = (
            scored
            if n == total
            else RewardOutput(scored.scores[:n], {k: v[:n] for k, v in scored.components.items()}, scored.metrics)
        )
        agent_scores: dict[AgentId, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        for agent, where in self.agents.items():
            device = scored.scores.device
            scores = scored.scores[torch.as_tensor(where.rows, device=device)].float()
            full = torch.zeros(n, dtype=torch.float32, device=device)
            full[torch.as_tensor(where.episodes, device=device)] = scores
            agent_scores[agent] = full
            metrics[f"reward/agent/{agent}"] = float(scores.mean())
        return team, (agent_scores if self.role else None), metrics


def credit_plan(episodes: Sequence[Episode], agent_ids: Sequence[AgentId] | None, credit: str) -> CreditPlan:
    """The rows to score for ``episodes`` under ``credit`` (``"team"`` or ``"role"``; see :class:`CreditPlan`).

    ``agent_ids`` are the environment's declared agents (their order is the metrics' order); an agent that acted
    without being declared follows them.
    """
    if credit not in CREDIT_MODES:
        raise ValueError(f"agents.credit: expected one of {', '.join(CREDIT_MODES)}, got {credit!r}")
    prompts, completions, metadata = reward_rows(episodes)
    row_of = {(e, len(ep.turns) - 1): e for e, ep in enumerate(episodes)}  # (episode, turn) -> row
    agents: dict[AgentId, AgentRows] = {}
    for agent in dict.fromkeys([*(agent_ids or ()), *(t.agent_id for ep in episodes for t in ep.turns)]):
        picked: list[int] = []
        rows: list[int] = []
        for e, ep in enumerate(episodes):
            turn = _last_turn(ep, agent)
            if turn is None:
                continue
            if (e, turn) not in row_of:
                row_of[(e, turn)] = len(prompts)
                prompt, completion, meta = _row(ep, turn)
                prompts.append(prompt)
                completions.append(completion)
                metadata.append(meta)
            picked.append(e)
            rows.append(row_of[(e, turn)])
        if picked:
            agents[agent] = AgentRows(picked, rows)
    return CreditPlan((prompts, completions, metadata), len(episodes), agents, role=credit == "role")
