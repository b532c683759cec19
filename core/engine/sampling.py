"""The sampling stage of a step: rollouts of the policy, scored by the reward, and (DAPO) refills.

:meth:`Sampler.sample` returns every row a step keeps. One rollout plays ``train.batch_size`` tasks x
``train.group_size`` completions; an algorithm with refill rounds (DAPO's dynamic sampling with refill) asks for
more rollouts, each with tasks and samples of its own, while it lacks groups that carry a training signal. The
loop calls this stage once per step and then works on all the rows together, so the step's reward statistics
(``reward/mean``, the EMA) cover every row it trains on.

Determinism: each rollout's tasks and sampling come from seeds derived from the run seed, the step and the refill
round (and the rank under torchrun), so a rollout is reproducible from those alone.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from palestra.engine.rollout import Rollout, RolloutRecipe
from palestra.multiagent.credit import credit_plan
from palestra.scale.reward_scoring import score_global
from palestra.types import AgentId, Experience, RewardOutput, SamplingParams

if TYPE_CHECKING:
    from palestra.config import Config
    from palestra.engine.checked_environment import CheckedEnvironment
    from palestra.engine.rollout_worker import RolloutWorker
    from palestra.engine.watchdog import StepWatchdog
    from palestra.scale.distributed import DistributedContext

__all__ = ["Round", "Sampled", "Sampler", "derive_seed", "episode_token_budget", "mean64"]


def derive_seed(seed: int, stream: str, index: int = 0) -> int:
    """A 63-bit seed for ``(seed, stream, index)``: independent streams (training tasks, held-out tasks, sampling)."""
    return random.Random(f"palestra/{seed}/{stream}/{index}").getrandbits(63)


def mean64(values: torch.Tensor) -> float:
    """The mean of ``values`` in float64: float32 scores near its limit (3e38) would overflow a float32 sum."""
    return float(values.detach().to(torch.float64).mean())


@dataclass
class Round:
    """One rollout, scored: its episodes, its rows, the reward's output on this rank's rows and the global batch's
    scores (every rank's rows), with the seconds spent sampling and scoring."""

    rollout: Rollout
    batch: Experience
    scored: RewardOutput
    global_scores: torch.Tensor
    agent_metrics: dict[str, float]
    generate_s: float  # the learner's time for the rollout (an asynchronous run's: waiting for the worker)
    reward_s: float
    version: int  # the weights it was sampled with (the step's own, unless the run is asynchronous)
    worker_generate_s: float | None = None  # an asynchronous run's: the worker's time sampling it
    worker_waited_s: float = 0.0  # an asynchronous run's: how long the worker waited for the request


def episode_token_budget(config: Config) -> int | None:
    """The cap on a multi-turn episode's whole token sequence: ``tools.max_tokens`` or ``agent.max_tokens``."""
    if config.tools is not None:
        return config.tools.max_tokens
    return config.agent.max_tokens if config.agent is not None else None


@dataclass
class Sampled:
    """What a step trains on: every row it kept, the global mean reward over them, and the sampling metrics."""

    batch: Experience
    mean_reward: float
    metrics: dict[str, float]


class Sampler:
    """Samples and scores a step's rows (see the module docstring).

    ``refill_rounds`` and ``groups_short`` are the algorithm's: how many extra rollouts a step may draw, and how
    many groups with a training signal a batch still lacks (0 rounds: no refill).
    """

    def __init__(
        self,
        config: Config,
        *,
        env: CheckedEnvironment,
        agent_ids: Sequence[AgentId],
        policy: Any,
        generator: Any,
        reward: Any,
        dist: DistributedContext,
        watchdog: StepWatchdog,
        autocast: Callable[[], AbstractContextManager[Any]],
        refill_rounds: int = 0,
        groups_short: Callable[[Experience], int] | None = None,
        trajectory: str = "per_turn",
    ) -> None:
        t = config.train
        self.config = config
        self.env, self.agent_ids, self.policy, self.generator, self.reward = env, agent_ids, policy, generator, reward
        self.dist, self.watchdog, self.autocast = dist, watchdog, autocast
        self.refill_rounds, self.groups_short = refill_rounds, groups_short
        self.recipe = RolloutRecipe(
            params=SamplingParams(max_new_tokens=t.max_new_tokens, temperature=t.temperature, top_p=t.top_p),
            batch_size=dist.local_batch_size(t.batch_size),
            group_size=t.group_size,
            trajectory=trajectory,  # type: ignore[arg-type]  # "sequence": one row per multi-turn episode
            max_tokens=episode_token_budget(config),  # a sequence's token budget
        )
        self.worker: RolloutWorker | None = None  # an asynchronous run's generation worker (attach_worker)
        self.rewarded = False  # whether the step being sampled has called the reward yet (its state moved)

    def attach_worker(self, worker: RolloutWorker | None) -> None:
        """Sample through ``worker`` from now on (None: in this process again)."""
        self.worker = worker

    def seeds(self, step: int, refill: int = 0) -> tuple[int, int]:
        """Step ``step``'s task seed and sampling seed (``refill``: its n-th extra rollout's)."""
        seed = self.config.run.seed
        # One process: the historical streams. Several: each rank its own task and sampling stream.
        stream = "" if not self.dist.enabled else f"/rank{self.dist.rank}"
        stream += f"/refill{refill}" if refill else ""
        return derive_seed(seed, "tasks" + stream, step), derive_seed(seed, "sampling" + stream, step)

    def request(self, step: int, refill: int = 0) -> None:
        """Ask the worker for step ``step``'s batch (the schedule is the trainer's; see rollout_worker)."""
        assert self.worker is not None
        self.worker.request(step, refill, *self.seeds(step, refill))

    def sample(self, step: int) -> Sampled:
        """Step ``step``'s rows: one rollout, then refills while the algorithm lacks groups with a signal."""
        self.rewarded = False
        rounds = [self.rollout(step)]
        batch = rounds[0].batch
        refill: dict[str, float] = {}
        if self.refill_rounds:
            batch, refill = self._refill(step, rounds)
        mean = mean64(torch.cat([r.global_scores for r in rounds]))
        return Sampled(batch, mean, {**self._metrics(step, rounds, batch), **refill})

    def rollout(self, step: int, refill: int = 0) -> Round:
        """Sample and score one rollout (``refill``: the step's n-th extra one, with tasks and samples of its own)."""
        if self.worker is not None:
            return self._worker_rollout(step, refill)
        task_seed, sampling_seed = self.seeds(step, refill)
        gen = torch.Generator(device=self.dist.device).manual_seed(sampling_seed)
        self.policy.eval()
        started = time.perf_counter()
        # Sampling runs in the training precision too (train.precision=bf16: the decode matmuls in bf16, the sampling
        # math in fp32); any gap to the learner's log-probs this leaves is logged as rollout/* and can be corrected.
        with self.watchdog.phase("rollout"), self.dist.gathered(self.policy), self.autocast():
            ro = self.recipe.collect(self.env, self.policy, self.generator, seed=task_seed, rng=gen)
        generate_s = time.perf_counter() - started
        return self.score(ro, generate_s, version=step)

    def _worker_rollout(self, step: int, refill: int) -> Round:
        """An asynchronous run's rollout: the worker's batch, sampled ahead with older weights, scored here."""
        assert self.worker is not None
        started = time.perf_counter()
        with self.watchdog.phase(self.worker.phase):
            if refill:  # refills are drawn when a step's batch lacks signal: requested now, with the batch's weights
                self.request(step, refill)
            got = self.worker.receive(step, refill)
        round_ = self.score(got.rollout, time.perf_counter() - started, version=got.version)
        round_.worker_generate_s, round_.worker_waited_s = got.generate_s, got.waited_s
        for row in round_.batch.metadata:  # every row says which weights sampled it (after the reward has scored it)
            row["policy_version"] = got.version
        return round_

    def score(self, ro: Rollout, generate_s: float, *, version: int) -> Round:
        """Score a rollout with the reward (the global batch under torchrun) and lay it out as training rows."""
        started = time.perf_counter()
        self.rewarded = True
        # multi-agent: one reward call over every row credit assignment needs (agents.credit "role" gives each agent's
        # rows its own turn's reward; per-agent metrics either way), then the plan splits that one output
        plan = (
            None if self.config.agents is None else credit_plan(ro.episodes, self.agent_ids, self.config.agents.credit)
        )
        with self.watchdog.phase("reward"):
            rows = ro.reward_rows() if plan is None else plan.rows
            scored, global_scores = score_global(self.reward, self.dist, *rows, counted=len(ro.episodes))
        agent_scores: dict[AgentId, torch.Tensor] | None = None
        agent_metrics: dict[str, float] = {}
        if plan is not None:
            scored, agent_scores, agent_metrics = plan.assign(scored)
        reward_s = time.perf_counter() - started
        batch = ro.experience(
            scored.scores, scored.components, pad_token_id=self.policy.tokenizer.pad_token_id, agent_scores=agent_scores
        )
        return Round(ro, batch, scored, global_scores, agent_metrics, generate_s, reward_s, version)

    def _refill(self, step: int, rounds: list[Round]) -> tuple[Experience, dict[str, float]]:
        """The first round's rows with more rollouts appended (to ``rounds``) while the algorithm lacks groups with a
        training signal, at most ``refill_rounds`` more. Every rank draws as many as the neediest one, so the
        rollouts' collectives stay in step."""
        assert self.groups_short is not None, "an algorithm with refill rounds counts the groups it lacks"
        batch = rounds[0].batch
        drawn, short = 0, self.groups_short(batch)
        while drawn < self.refill_rounds and self.dist.any_true(short > 0):
            drawn += 1
            more = self.rollout(step, refill=drawn)
            more.batch.group_ids = (
                more.batch.group_ids + int(batch.group_ids.max()) + 1
            )  # a fresh rollout numbers from 0
            batch = Experience.concat([batch, more.batch], pad_token_id=self.policy.tokenizer.pad_token_id)
            rounds.append(more)
            short = self.groups_short(batch)
        return batch, {"rollout/refill_rounds": float(drawn), "rollout/groups_short": float(short)}

    def _metrics(self, step: int, rounds: list[Round], batch: Experience) -> dict[str, float]:
        """The sampling metrics over every kept row (the mean reward and its EMA are the trainer's)."""
        first, last = rounds[0].scored, rounds[-1].scored
        components = {
            f"reward/{k}": mean64(torch.cat([r.scored.components[k] for r in rounds])) for k in first.components
        }
        generated = int(batch.completion_mask.sum())
        generate_s = sum(r.generate_s for r in rounds)
        sampling_s = generate_s if self.worker is None else sum(r.worker_generate_s or 0.0 for r in rounds)
        metrics = {
            **components,
            **{f"curriculum/{k}": v for k, v in last.metrics.items()},  # the reward's state after the step's last call
            "response/length": generated / max(1, batch.batch_size),
            "perf/gen_tokens_per_s": generated / max(sampling_s, 1e-9),
            "perf/generate_s": generate_s,  # the rollouts: environment calls and sampling (async: waiting for them)
            "perf/reward_s": sum(r.reward_s for r in rounds),
            # per-agent scores of the first rollout (a multi-agent algorithm draws no refills)
            **rounds[0].agent_metrics,
        }
        if self.worker is not None:  # only then: a synchronous run logs what it always did
            metrics.update(
                {
                    "rollout/policy_lag": sum(step - r.version for r in rounds) / len(rounds),
                    "perf/learner_wait_s": generate_s,
                    "perf/generator_wait_s": sum(r.worker_waited_s for r in rounds),
                    "perf/worker_generate_s": sampling_s,
                }
            )
        best = self.reward.max_score
        if best is not None:
            metrics["reward/max"] = best
        if self.config.tools is not None:  # only then: a run without tools logs what it always did
            from palestra.tools.metrics import tool_metrics

            metrics.update(tool_metrics([ep for r in rounds for ep in r.rollout.episodes]))
        if self.config.agent is not None:  # likewise: only a run with an agent: section logs the agent metrics
            from palestra.agents.metrics import agent_metrics

            metrics.update(agent_metrics([ep for r in rounds for ep in r.rollout.episodes]))
        # an environment with metrics of its own (openenv's skipped episodes) reports them over the step's episodes
        env_metrics = getattr(self.env, "rollout_metrics", None)
        if callable(env_metrics):
            metrics.update(env_metrics([ep for r in rounds for ep in r.rollout.episodes]))
        return metrics
