"""Driving an :class:`~palestra.types.Environment` to the end of its episodes, and laying episodes out as training rows.

This is the reference semantics of the environment protocol: the trainer's rollout loop does the same with a
policy as the responder. What a reward sees of an episode (:func:`reward_rows`) is credit assignment's business
(:mod:`palestra.multiagent.credit`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from palestra.engine.trajectory import SequenceRecord, Trajectories
from palestra.multiagent.credit import reward_rows
from palestra.multiagent.generation import generate_by_agent
from palestra.types import (
    AgentId,
    Environment,
    Episode,
    Experience,
    Generation,
    Generator,
    Observation,
    Policy,
    SamplingParams,
    Turn,
)

if TYPE_CHECKING:
    import torch

Responder = Callable[[list[Observation]], Sequence[str]]
"""Given the live rows' observations, return one completion per observation (same order)."""


def run_episodes(
    env: Environment, respond: Responder, batch_size: int, *, seed: int | None = None, group_size: int = 1
) -> list[Episode]:
    """Reset ``env`` and step it until every episode is done or ``env.max_turns`` turns have passed.

    ``respond`` is called once per turn with the observations of the rows still running (it may dispatch on
    ``obs.agent_id`` to play several agents). Returns one :class:`Episode` per row, in row order.
    """
    return drive(env, lambda rows, obs: respond(obs), batch_size, seed=seed, group_size=group_size)


RowResponder = Callable[[list[int], list[Observation]], Sequence[str]]
"""A :data:`Responder` that is also told the live rows (the episodes' indices), in the same order."""
EndRows = Callable[[list[int], list[Observation]], Sequence[int]]
"""Given the rows that go on and their next observations, the rows to end now (truncated), such as those over a
token budget."""


def drive(
    env: Environment,
    respond: RowResponder,
    batch_size: int,
    *,
    seed: int | None = None,
    group_size: int = 1,
    end_rows: EndRows | None = None,
) -> list[Episode]:
    """:func:`run_episodes` with a responder told the rows, and ``end_rows`` to end episodes early (truncated, as at
    ``max_turns``: the environment is not told, and the episode's last turn is the one it played)."""
    observations: list[Observation | None] = list(env.reset(batch_size, seed=seed, group_size=group_size))
    n = len(observations)
    if n != batch_size * group_size:
        raise ValueError(
            f"{type(env).__name__}.reset returned {n} observations for batch_size*group_size={batch_size * group_size}"
        )
    episodes = [Episode(metadata=dict(obs.metadata)) for obs in observations if obs is not None]
    for _ in range(env.max_turns):
        live = [i for i, obs in enumerate(observations) if obs is not None]
        if not live:
            break
        live_obs = [observations[i] for i in live]
        replies = list(respond(live, live_obs))  # type: ignore[arg-type]
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
        going = [i for i, obs in enumerate(observations) if obs is not None]
        if end_rows is not None and going:
            for i in end_rows(going, [observations[i] for i in going]):  # type: ignore[misc]
                observations[i] = None
                episodes[i].truncated = True
    for i, obs in enumerate(observations):
        if obs is not None:
            episodes[i].truncated = True
    return episodes


# ---- rollouts with a policy ----------------------------------------------------------------------------
@dataclass
class Rollout:
    """Finished episodes and, for every turn, the tokens the policy produced.

    ``generations[c]`` is turn ``c`` of every episode that lasted that long, in episode order (the rows
    :func:`run_episodes` handed the responder). :meth:`experience` lays the turns out one row each,
    episode-major, so the rows of one task group stay consecutive.
    """

    episodes: list[Episode]
    generations: list[Generation]
    group_size: int = 1
    # one sequence per episode (train.trajectory: sequence), None for an episode that fell back to per-turn rows;
    # None altogether: per-turn rows
    sequences: list[SequenceRecord | None] | None = None

    def rows(self) -> list[tuple[int, int, int]]:
        """``(episode, turn, row in generations[turn])`` for every training row, episode-major; an episode trained
        as one sequence has one row, ``(episode, -1, -1)``."""
        position: dict[tuple[int, int], int] = {}
        for c in range(len(self.generations)):
            alive = [e for e, ep in enumerate(self.episodes) if len(ep.turns) > c]
            position.update({(e, c): r for r, e in enumerate(alive)})
        out: list[tuple[int, int, int]] = []
        for e, ep in enumerate(self.episodes):
            if self.sequences is not None and self.sequences[e] is not None:
                out.append((e, -1, -1))
            else:
                out.extend((e, c, position[(e, c)]) for c in range(len(ep.turns)))
        return out

    def reward_rows(self, agent_id: AgentId | None = None) -> tuple[list[str], list[str], list[dict[str, Any]]]:
        """One reward row per episode: its last turn, or its last turn by ``agent_id`` (see :func:`reward_rows`)."""
        return reward_rows(self.episodes, agent_id)

    def experience(
        self,
        scores: torch.Tensor,
        components: Mapping[str, torch.Tensor] | None = None,
        *,
        pad_token_id: int = 0,
        agent_scores: Mapping[AgentId, torch.Tensor] | None = None,
    ) -> Experience:
        """An :class:`Experience` with one row per turn; each turn gets its episode's reward (the team reward).

        With ``agent_scores`` (role credit: ``agent_scores[a][e]`` is episode ``e``'s reward for agent ``a``'s own
        turn), each row gets its agent's entry instead. Every row's metadata holds the episode's metadata, the
        ``turn``, the ``agent_id`` and the joint ``state`` text (a centralised critic's input; see :func:`joint_state`).
        """
        import torch

        rows = self.rows()
        episode_of = torch.tensor([e for e, _, _ in rows], dtype=torch.int64)
        picked: list[tuple[torch.Tensor, ...]]  # (prompt ids, prompt mask, completion ids, mask, log-probs) per piece
        if len(self.generations) == 1:  # single-turn: the rows are the generation itself
            g = self.generations[0]
            picked = [(g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, g.logprobs)]
        else:  # one row per turn or per sequence, re-padded to common widths
            picked = [self._row_tensors(e, c, r) for e, c, r in rows]
        pieces = [
            Experience(
                prompt_ids=p,
                prompt_mask=pm,
                completion_ids=c,
                completion_mask=cm,
                behaviour_logprobs=lp,
                rewards=torch.zeros(p.shape[0]),
                advantages=torch.zeros(p.shape[0]),
                group_ids=torch.zeros(p.shape[0], dtype=torch.int64),
                agent_ids=[""] * p.shape[0],
            )
            for p, pm, c, cm, lp in picked
        ]
        batch = pieces[0] if len(pieces) == 1 else Experience.concat(pieces, pad_token_id)
        device = batch.completion_ids.device
        episode_of = episode_of.to(device)
        batch.rewards = scores.to(device=device, dtype=torch.float32)[episode_of]
        batch.advantages = torch.zeros_like(batch.rewards)
        batch.group_ids = torch.div(episode_of, self.group_size, rounding_mode="floor")
        batch.reward_components = {
            k: v.to(device=device, dtype=torch.float32)[episode_of] for k, v in (components or {}).items()
        }
        batch.agent_ids = [self.episodes[e].turns[max(c, 0)].agent_id for e, c, _ in rows]
        if agent_scores is not None:
            per_agent = {a: v.to(device=device, dtype=torch.float32) for a, v in agent_scores.items()}
            batch.rewards = torch.stack([per_agent[a][e] for a, (e, _, _) in zip(batch.agent_ids, rows)])
        batch.metadata = [self._row_metadata(e, c) for e, c, _ in rows]
        return batch

    def _row_metadata(self, e: int, c: int) -> dict[str, Any]:
        """A training row's metadata; a sequence row (``c == -1``) is its whole episode (``turns`` turns)."""
        episode = self.episodes[e]
        turn = max(c, 0)
        extra = {"turns": len(episode.turns)} if c < 0 else {}
        return {
            **episode.metadata,
            "turn": turn,
            **extra,
            "agent_id": episode.turns[turn].agent_id,
            "state": joint_state(episode, turn),
        }

    def _row_tensors(self, e: int, c: int, r: int) -> tuple[torch.Tensor, ...]:
        if c < 0:
            assert self.sequences is not None
            record = self.sequences[e]
            assert record is not None
            return record.tensors(self.generations[0].completion_ids.device)
        g = self.generations[c]
        return tuple(
            x[r : r + 1] for x in (g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, g.logprobs)
        )


@dataclass(frozen=True)
class RolloutRecipe:
    """What every training rollout of a run is made of, wherever it is sampled (in the learner's process, or in an
    asynchronous run's worker): the sampling settings, this rank's tasks and group size, the trajectory kind and
    a sequence's token budget."""

    params: SamplingParams
    batch_size: int
    group_size: int
    trajectory: Literal["per_turn", "sequence"]
    max_tokens: int | None

    def collect(
        self, env: Environment, policy: Policy, backend: Generator, *, seed: int, rng: torch.Generator
    ) -> Rollout:
        """:func:`collect` with this recipe: tasks from ``seed``, sampling from ``rng``."""
        return collect(
            env,
            policy,
            backend,
            self.params,
            self.batch_size,
            group_size=self.group_size,
            seed=seed,
            rng=rng,
            trajectory=self.trajectory,
            max_tokens=self.max_tokens,
        )


def collect(
    env: Environment,
    policy: Policy,
    backend: Generator,
    params: SamplingParams,
    batch_size: int,
    *,
    group_size: int = 1,
    seed: int | None = None,
    rng: torch.Generator | None = None,
    trajectory: Literal["per_turn", "sequence"] = "per_turn",
    max_tokens: int | None = None,
) -> Rollout:
    """Play ``batch_size * group_size`` episodes, ``policy`` answering every turn through the generation ``backend``.

    ``seed`` picks the environment's tasks; ``rng`` drives the sampling. ``trajectory="sequence"`` keeps each
    episode as one token sequence (:mod:`palestra.engine.trajectory`), which ``max_tokens`` caps: an episode whose
    sequence reaches it ends there, truncated.
    """
    generations: list[Generation] = []
    kept = None
    if trajectory == "sequence":
        end_ids = [policy.tokenizer.eos_token_id, *params.stop_token_ids]
        kept = Trajectories(policy, batch_size * group_size, end_ids=end_ids, max_tokens=max_tokens)

    def respond(rows: list[int], observations: list[Observation]) -> list[str]:
        if kept is not None:
            observations = kept.prepare(rows, observations)
        out = generate_by_agent(backend, policy, observations, params, rng=rng)
        generations.append(out)
        if kept is not None:
            kept.record(rows, observations, out)
        return list(out.texts)

    end_rows = None if kept is None else kept.advance
    episodes = drive(env, respond, batch_size, seed=seed, group_size=group_size, end_rows=end_rows)
    return Rollout(episodes, generations, group_size, None if kept is None else kept.records)


# ---- multi-agent additions -----------------------------------------------------------------------------
def joint_state(episode: Episode, turn: int) -> str:
    """The joint state before ``turn`` of ``episode``: the observation's ``metadata["state"]`` when the environment
    provides one, else every earlier turn's ``[agent] completion`` followed by this turn's prompt."""
    obs = episode.turns[turn].observation
    state = obs.metadata.get("state") if obs.metadata else None
    if isinstance(state, str):
        return state
    earlier = [f"[{t.agent_id}] {t.completion}" for t in episode.turns[:turn]]
    return "\n".join([*earlier, obs.prompt])
