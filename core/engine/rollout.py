"""Driving an :class:`~palestra.types.Environment` to the end of its episodes, and laying episodes out as training rows.

This is the reference semantics of the environment protocol: the trainer's rollout loop does the same with a
policy as the responder. What a reward sees of an episode (:func:`reward_rows`) is credit assignment's business
(:mod:`palestra.multiagent.credit`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

    def rows(self) -> list[tuple[int, int, int]]:
        """``(episode, turn, row in generations[turn])`` for every turn, episode-major."""
        position: dict[tuple[int, int], int] = {}
        for c in range(len(self.generations)):
            alive = [e for e, ep in enumerate(self.episodes) if len(ep.turns) > c]
            position.update({(e, c): r for r, e in enumerate(alive)})
        return [(e, c, position[(e, c)]) for e, ep in enumerate(self.episodes) for c in range(len(ep.turns))]

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
        else:  # one row per turn, re-padded to common widths
            picked = [tuple(x[r : r + 1] for x in self._tensors(c)) for _, c, r in rows]
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
        batch.agent_ids = [self.episodes[e].turns[c].agent_id for e, c, _ in rows]
        if agent_scores is not None:
            per_agent = {a: v.to(device=device, dtype=torch.float32) for a, v in agent_scores.items()}
            batch.rewards = torch.stack([per_agent[a][e] for a, (e, _, _) in zip(batch.agent_ids, rows)])
        batch.metadata = [
            {
                **self.episodes[e].metadata,
                "turn": c,
                "agent_id": self.episodes[e].turns[c].agent_id,
                "state": joint_state(self.episodes[e], c),
            }
            for e, c, _ in rows
        ]
        return batch

    def _tensors(self, turn: int) -> tuple[torch.Tensor, ...]:
        g = self.generations[turn]
        return g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask, g.logprobs


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
) -> Rollout:
    """Play ``batch_size * group_size`` episodes, ``policy`` answering every turn through the generation ``backend``.

    ``seed`` picks the environment's tasks; ``rng`` drives the sampling.
    """
    generations: list[Generation] = []

    def respond(observations: list[Observation]) -> list[str]:
        out = generate_by_agent(backend, policy, observations, params, rng=rng)
        generations.append(out)
        return list(out.texts)

    episodes = run_episodes(env, respond, batch_size, seed=seed, group_size=group_size)
    return Rollout(episodes, generations, group_size)


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
