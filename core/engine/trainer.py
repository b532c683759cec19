"""The training loop, and nothing else: rollout -> reward -> advantages -> update -> metrics, once per step.

Data flows one way (the README's architecture map): the environment makes observations, the generator samples
completions from the policy, the reward scores finished episodes (the sampling stage,
:mod:`palestra.engine.sampling`, which also draws DAPO's refills), the algorithm turns the scored batch into an
update, and the metrics go to the loggers and the lifecycle hooks (a read-only
:class:`~palestra.run_state.RunState`). Nothing downstream reaches back upstream. The components come built
(:func:`palestra.config.build_run`); checkpoint state is :mod:`palestra.engine.checkpoint`'s.

Determinism: the run seed fixes the initial weights, every step's tasks (a seed per step drawn from the run
seed) and every step's sampling (a ``torch.Generator`` per step), so the same seed gives the same numbers
on the same machine and thread count, and a run resumed from a checkpoint continues bitwise as if it had
never stopped (see :mod:`palestra.engine.checkpoint`).

Under torchrun (:mod:`palestra.scale.distributed`) each rank plays ``train.batch_size / world_size`` tasks from its
own seed stream, the reward scores the global batch (so a curriculum advances identically on every rank),
gradients are averaged (ddp) or reduce-scattered (fsdp), metrics are averaged, and rank 0 alone logs and
writes checkpoints. Resilience: every phase of a step runs under a :class:`~palestra.engine.watchdog.StepWatchdog`
(``train.step_timeout_s``), environment calls under ``train.data_timeout_s`` and the protocol checks of
:class:`~palestra.engine.checked_environment.CheckedEnvironment`, and a step whose reward (a row) or update is
not finite is skipped with a warning; ``train.max_bad_steps`` skipped steps in a row end the
run. SIGINT and SIGTERM stop the run at the next step boundary with a checkpoint
(:class:`~palestra.engine.watchdog.StopSignals`).
"""

from __future__ import annotations

import sys
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from palestra.checked_reward import RewardError
from palestra.config import Config, RunComponents, build_run
from palestra.engine import checkpoint as ckpt
from palestra.engine.checked_environment import CheckedEnvironment
from palestra.engine.learner import Learner
from palestra.engine.rollout import collect
from palestra.engine.rollout_worker import RolloutWorker, RolloutWorkerError, check_async
from palestra.engine.sampling import Sampled, Sampler, derive_seed, episode_token_budget, mean64
from palestra.engine.trajectory import choose_trajectory
from palestra.engine.watchdog import Interrupted, StepWatchdog, StopSignals
from palestra.plugin_manager import get_plugin_manager
from palestra.run_state import RunState
from palestra.scale.distributed import DistributedContext
from palestra.types import Experience, SamplingParams

__all__ = ["EvalResult", "Interrupted", "TrainResult", "Trainer", "TrainingAborted", "derive_seed"]

# The parts of a step's time; disjoint intervals inside it, so the overhead (hooks, building the batch) is the rest.
_TIME_PARTS = ("perf/generate_s", "perf/reward_s", "perf/score_s", "perf/update_s")


class TrainingAborted(RuntimeError):
    """``train.max_bad_steps`` steps in a row were skipped (non-finite reward or update). One line."""

    palestra_user_error = True


class NonFiniteStepWarning(UserWarning):
    """A step was skipped because its reward or its update was not finite."""


@dataclass
class EvalResult:
    """Held-out reward: mean total and mean per component, over ``tasks`` tasks (greedy decoding)."""

    reward: float
    components: dict[str, float]
    tasks: int
    max_score: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "components": dict(self.components),
            "tasks": self.tasks,
            "max_score": self.max_score,
        }

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        out = {f"{prefix}/reward": self.reward}
        out.update({f"{prefix}/{k}": v for k, v in self.components.items()})
        return out


@dataclass
class TrainResult:
    before: EvalResult
    after: EvalResult
    last_metrics: dict[str, float]
    run_dir: Path
    steps: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    """Runs the components :func:`~palestra.config.build_run` built for ``config`` (see the module docstring).

    ``components``: the run's components, already built; by default they are built here, on the ranks torchrun
    started (:meth:`DistributedContext.from_config <palestra.scale.distributed.DistributedContext.from_config>`).
    """

    def __init__(
        self,
        config: Config,
        *,
        run_dir: str | Path | None = None,
        components: RunComponents | None = None,
        stop_signals: StopSignals | None = None,
    ) -> None:
        if components is None:
            components = build_run(config, DistributedContext.from_config(config, config.train.device))
        elif components.config is not config:
            raise ValueError("Trainer: the components were built from another config")
        self.config, self.components = config, components
        c = components
        self.dist, self.device, self.context = c.dist, c.dist.device, c.context
        self.env, self.eval_env, self.reward, self.loggers = c.env, c.eval_env, c.reward, c.loggers
        self.generator, self.algorithm, self.policy, self.reference = c.generator, c.algorithm, c.policy, c.reference
        # The update's mechanics around the algorithm's RL content: optimisers, micro-batches, precision, replay.
        self.learner = Learner(self.algorithm, self.policy, self.context, reference=self.reference)
        self.run_dir = Path(run_dir) if run_dir is not None else Path(config.run.output_dir) / config.run.name
        self.hooks = get_plugin_manager().hook
        self.watchdog = StepWatchdog(config.train.step_timeout_s)
        # The environments as every step calls them: timed and checked against the protocol (built once).
        self.checked_env, self.checked_eval_env = self.checked(self.env), self.checked(self.eval_env)
        agent_ids = self.env.agent_ids if config.agents is not None else ()  # credit assignment's, multi-agent only
        # one token sequence per multi-turn episode, or per-turn rows (said at start-up: trajectory_line)
        self.trajectory, self.trajectory_line = choose_trajectory(
            config.train.trajectory, self.env, self.policy, per_agent=config.agents is not None
        )
        self.sampler = Sampler(
            config,
            env=self.checked_env,
            agent_ids=agent_ids,
            policy=self.policy,
            generator=self.generator,
            reward=self.reward,
            dist=self.dist,
            watchdog=self.watchdog,
            autocast=self.context.autocast,
            refill_rounds=self.algorithm.refill_rounds,
            groups_short=self.algorithm.groups_short,
            trajectory=self.trajectory,
        )
        self.local_batch_size = self.sampler.recipe.batch_size
        # train.async: a generation worker `lag` steps ahead (palestra.engine.rollout_worker), started by train()
        self.lag = config.train.async_.lag if config.train.async_ is not None else 0
        if self.lag:
            check_async(config, self.env, self.dist)
        self.worker: RolloutWorker | None = None
        self._earlier_versions: dict[int, dict[str, torch.Tensor]] = {}  # a resumed async run's, from its checkpoint
        # palestra train passes the handlers it holds for the whole command (start-up and the last phase too); the
        # trainer's own block nests in it, so one signal is one flag whichever phase it arrives in.
        self.stop_signals = stop_signals if stop_signals is not None else StopSignals()
        # Written into every checkpoint, so that resume never continues another run that used the same directory.
        # Rank 0's id on every rank: the checkpoints it writes and run.json agree.
        self.run_id: str = self.dist.broadcast_object(uuid.uuid4().hex)
        self.saved_step: int | None = None  # the step of the newest checkpoint written (or loaded)
        self.step_index = 0  # the steps taken so far
        self.reward_ema: float | None = None
        self.bad_steps = 0  # consecutive skipped steps
        self.before: EvalResult | None = None  # the held-out reward before training (restored on resume)
        # Loaded from the final checkpoint of a run already at train.steps: its final evaluation is in the log
        # (the checkpoint recorded the log's size after it), so resuming it must not log that step again.
        self.finished_at_load = False
        self._log_sizes: dict[str, int] = {}  # logged file sizes at the loaded checkpoint
        self._log_source: str | Path = "(state)"  # the checkpoint they were read from

    def checked(self, env: Any) -> CheckedEnvironment:
        """``env`` with its calls timed (``train.data_timeout_s``, the watchdog) and checked against the protocol."""
        return CheckedEnvironment(
            env, name=self.config.environment.name, timeout_s=self.config.train.data_timeout_s, watchdog=self.watchdog
        )

    def run_state(self, metrics: Mapping[str, float] | None = None) -> RunState:
        """What the lifecycle hooks see of the run now (read-only)."""
        return RunState(
            step=self.step_index,
            config=self.config,
            run_dir=self.run_dir,
            metrics=metrics or {},
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )

    # ---- one step --------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One step: rollout -> reward -> advantages -> update -> metrics -> hooks. Returns the step's metrics."""
        started = time.perf_counter()
        self.watchdog.set_step(self.step_index)
        self.hooks.on_step_start(run=self.run_state())
        try:
            sampled = self.sampler.sample(self.step_index)  # rollouts scored by the reward, refills included
        except RewardError as e:
            if not e.nonfinite:
                raise
            return self._skip(f"the reward is not finite ({e})", {}, started)
        metrics = self._reward_metrics(sampled)
        self.hooks.on_rollout_end(run=self.run_state(metrics), batch=sampled.batch)
        self.policy.train()
        with self.watchdog.phase("update"):
            scoring = time.perf_counter()
            batch = self.learner.prepare(sampled.batch.validate())  # reference log-probs, advantages
            updating = time.perf_counter()
            metrics.update(self.learner.update(batch))
            metrics["perf/score_s"] = updating - scoring
            metrics["perf/update_s"] = time.perf_counter() - updating  # forwards, backwards, optimiser steps
        self.hooks.on_update_end(run=self.run_state(metrics), batch=batch)
        if metrics.get("train/skipped", 0.0):
            return self._skip("the loss or the gradient norm is not finite", metrics, started, updated=True)
        self.bad_steps = 0
        metrics = self.dist.all_reduce_mean(_with_times(metrics, started, batch))
        self.step_index += 1
        self._next_version()
        self.hooks.on_optimizer_step(run=self.run_state(metrics))
        return metrics

    def _next_version(self) -> None:
        """An asynchronous run: the weights after this step go to the worker, with the request that they serve (the
        batch ``lag`` steps on)."""
        if self.worker is None:
            return
        self.worker.publish(self.step_index)
        ahead = self.step_index + self.lag
        if ahead < self.config.train.steps:
            self.sampler.request(ahead)

    def _reward_metrics(self, sampled: Sampled) -> dict[str, float]:
        """The step's reward metrics, with the reward EMA advanced once, over every row the step kept."""
        mean, decay = sampled.mean_reward, self.config.train.reward_ema
        self.reward_ema = mean if self.reward_ema is None else decay * self.reward_ema + (1 - decay) * mean
        return {"reward/mean": mean, "reward/ema": self.reward_ema, **sampled.metrics}

    def _skip(self, why: str, metrics: dict[str, float], started: float, *, updated: bool = False) -> dict[str, float]:
        """Count a skipped step (no optimiser step was taken); abort after ``train.max_bad_steps`` in a row."""
        self.bad_steps += 1
        limit, step = self.config.train.max_bad_steps, self.step_index
        if self.dist.is_main:
            warnings.warn(
                f"step {step + 1} skipped: {why} ({self.bad_steps} in a row, limit train.max_bad_steps={limit})",
                NonFiniteStepWarning,
                stacklevel=3,
            )
        if self.bad_steps >= limit:
            raise TrainingAborted(
                f"train.max_bad_steps: {self.bad_steps} steps in a row were skipped (non-finite reward, loss or "
                f"gradient); the last, step {step + 1}: {why}"
            )
        elapsed = time.perf_counter() - started
        metrics = {**{k: v for k, v in metrics.items() if isinstance(v, float)}, "train/skipped": 1.0}
        # A phase the step never reached took no time: the parts still sum to the step time.
        metrics.update({k: metrics.get(k, 0.0) for k in _TIME_PARTS})
        metrics["perf/overhead_s"] = max(0.0, elapsed - sum(metrics[k] for k in _TIME_PARTS))
        metrics["perf/step_s"] = elapsed
        metrics = self.dist.all_reduce_mean(metrics) if updated else metrics
        self.step_index += 1
        self._next_version()  # the same weights, a new version: the schedule stays fixed
        return metrics

    # ---- evaluation --------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, tasks: int | None = None) -> EvalResult:
        """Held-out reward with greedy decoding on tasks drawn from a seed stream training never uses."""
        t = self.config.train
        n = tasks or t.eval_size
        self.policy.eval()
        params = SamplingParams(max_new_tokens=t.max_new_tokens, temperature=0.0)
        # Every rank evaluates the same tasks (the same greedy answers: the weights are identical), so that FSDP's
        # collectives see every rank and the number needs no reduction.
        with self.watchdog.phase("eval"), self.dist.gathered(self.policy), self.context.autocast():
            ro = collect(
                self.checked_eval_env,
                self.policy,
                self.generator,
                params,
                n,
                seed=derive_seed(self.config.run.seed, "held-out"),
                trajectory=self.trajectory,  # type: ignore[arg-type]
                max_tokens=episode_token_budget(self.config),
            )
            scored = self.reward.evaluate(*ro.reward_rows())
        comps = {k: mean64(v) for k, v in scored.components.items()}
        return EvalResult(mean64(scored.scores), comps, n, self.reward.max_score)

    # ---- the loop --------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Train to ``train.steps``. SIGINT/SIGTERM/SIGHUP end it at the next step boundary, after a checkpoint, with
        :class:`Interrupted` (see :meth:`_stop_if_signalled`); one that comes after the last step lets the final
        evaluation and checkpoint finish and stays in ``stop_signals.received``. A second signal raises at once."""
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.check_run_folder(self.run_dir)  # a link in the folder: refused before anything is cut or written
            # a resumed run rewrites what followed its checkpoint
            ckpt.restore_logs(self.run_dir, self._log_sizes, self.step_index, source=self._log_source)
        plain = self.config.to_dict()
        for logger in self.loggers:
            logger.open(self.run_dir, plain)
        started = time.perf_counter()
        history: list[dict[str, float]] = []
        metrics: dict[str, float] = {}
        self.watchdog.start()
        try:
            with self.stop_signals:
                self._start_worker()
                self.hooks.on_train_start(run=self.run_state())
                if self.before is None:
                    self.before = self.evaluate()
                    self._log(self.before.metrics(), 0)
                after = self._train_steps(history)
                metrics = history[-1] if history else {}
                self.hooks.on_train_end(run=self.run_state(metrics))
        except Interrupted as e:
            if e.at_once:  # a second signal: say what there is to resume from
                e.saved_step, e.run_dir = self.saved_step, self.run_dir
            raise
        finally:
            self.watchdog.stop()
            if self.worker is not None:
                self.sampler.attach_worker(None)
                self.worker.close()
                self.worker = None
            for logger in self.loggers:
                logger.close()
            if self.config.agent is not None:  # the rollout endpoint: its thread, socket and agents end with the run
                for env in (self.env, self.eval_env):
                    env.close()
        return TrainResult(
            self.before, after, metrics, self.run_dir, self.step_index, time.perf_counter() - started, history
        )

    def _start_worker(self) -> None:
        """An asynchronous run: start the worker with the weights it needs, and request the batches sampled before
        the first step's update (``lag + 1`` of them: ``step .. step + lag``)."""
        t = self.config.train
        if not self.lag or self.step_index >= t.steps:
            return
        first = self.step_index
        missing = [v for v in range(max(0, first - self.lag), first) if v not in self._earlier_versions]
        if missing:
            raise RolloutWorkerError(
                f"train.async.lag={self.lag}: the checkpoint at step {first} lacks the weights of versions "
                f"{missing} that its in-flight batches were sampled with (was it written with a smaller lag?); resume "
                "with the lag it was written with"
            )
        with self.watchdog.phase("rollout worker start"):
            self.worker = RolloutWorker(
                self.config,
                policy=self.policy,
                version=first,
                earlier=self._earlier_versions,
                recipe=self.sampler.recipe,
                device=self.device,
            )
        self._earlier_versions = {}
        self.sampler.attach_worker(self.worker)
        for step in range(first, min(first + self.lag + 1, t.steps)):
            self.sampler.request(step)
        if self.dist.is_main:
            threads = t.async_.threads if t.async_ is not None else 1
            print(
                f"palestra: rollout worker pid {self.worker.pid}, {threads} CPU thread{'s' if threads > 1 else ''}, "
                f"sampling {self.lag} step{'s' if self.lag > 1 else ''} ahead of the learner",
                file=sys.stderr,
            )

    def _train_steps(self, history: list[dict[str, float]]) -> EvalResult:
        """The steps from ``self.step_index`` to ``train.steps``, the final evaluation and checkpoint."""
        t = self.config.train
        while True:
            self._stop_if_signalled()
            if self.step_index >= t.steps:
                break
            try:
                metrics = self.step()
            except RolloutWorkerError as e:
                raise RolloutWorkerError(f"{e}; {self._save_after_worker_fault()}") from None
            if t.eval_every and self.step_index % t.eval_every == 0 and self.step_index < t.steps:
                metrics.update(self.evaluate().metrics())
            history.append(metrics)
            if self.step_index % t.log_every == 0 or self.step_index == t.steps:
                self._log(metrics, self.step_index)
            if t.save_every and self.step_index % t.save_every == 0 and self.step_index < t.steps:
                self.save_step()
        after = self.evaluate()
        if not self.finished_at_load:
            self._log(after.metrics(), self.step_index)
        self.save()
        return after

    def _save_after_worker_fault(self) -> str:
        """The worker failed during a step: save the step boundary before it (the step had not updated; the ring still
        holds the in-flight batches' weights) and say where to resume from. Not once the step has called the reward
        (a DAPO refill that never came): the reward's state has moved past the boundary."""
        # Under torchrun a save is collective, and the other ranks are elsewhere.
        if self.dist.enabled or self.sampler.rewarded:
            return _newest_checkpoint(self.run_dir)
        if self.saved_step != self.step_index:
            self.save_step()
        return f"the run saved step {self.step_index}: palestra train --resume {self.run_dir} continues it"

    def _stop_if_signalled(self) -> None:
        """At a step boundary before the last: if a rank got SIGINT/SIGTERM/SIGHUP, save this step and raise
        :class:`Interrupted`. After the last step the run finishes instead, leaving the signal in
        ``stop_signals.received`` for the caller.

        Every rank takes part (one all-reduce of a flag per step), so all stop at the same step; the signal
        reported (and so the exit status) is rank 0's when it got one.
        """
        if self.step_index >= self.config.train.steps:
            # The last step is done: the final evaluation and checkpoint follow (and, from palestra train, the
            # table, the dashboard and the export); the command then exits with the signal's status. Every rank
            # is at the same step, so all skip the collective below.
            return
        if not self.dist.any_true(self.stop_signals.received is not None):
            return
        signum = next(s for s in self.dist.all_gather_object(self.stop_signals.received) if s is not None)
        if self.saved_step != self.step_index:
            self.save_step()
        raise Interrupted(signum, saved_step=self.step_index, run_dir=self.run_dir)

    def _log(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        for logger in self.loggers:
            logger.log(clean, step)

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's state (:func:`palestra.engine.checkpoint.capture_state`), with what plugins add to it.
        Collective under torchrun: every rank must call it; the complete state is meaningful on rank 0."""
        state = ckpt.capture_state(
            self.components,
            self.learner,
            step=self.step_index,
            run_id=self.run_id,
            reward_ema=self.reward_ema,
            bad_steps=self.bad_steps,
            before=self.before.to_dict() if self.before is not None else None,
            run_dir=self.run_dir,
        )
        if self.worker is not None:  # the weights the batches in flight were sampled with: a resume samples them again
            state["async"] = {"lag": self.lag, "versions": self.worker.versions_state(self.step_index)}
        self.hooks.on_checkpoint_save(run=self.run_state(), state=state)
        return state

    def save(self, path: str | Path | None = None) -> Path:
        """Write the final checkpoint (``RUN_DIR/checkpoint.pt``, or ``path``) atomically: a temporary file in the same
        folder, fsynced, then renamed over the target. Under torchrun every rank calls it and rank 0 writes."""
        target = Path(path) if path is not None else self.run_dir / ckpt.FINAL_NAME
        with self.watchdog.phase("checkpoint"):
            state = self.state_dict()
            if self.dist.is_main:
                ckpt.save_checkpoint(state, target)
        self.saved_step = self.step_index
        return target

    def save_step(self) -> Path:
        """Write ``RUN_DIR/checkpoints/step-NNNNNN.pt`` atomically, point ``latest`` at it, keep the newest
        ``train.keep_checkpoints``."""
        with self.watchdog.phase("checkpoint"):
            state = self.state_dict()
            path = self.run_dir / ckpt.CHECKPOINT_DIR / ckpt.step_name(self.step_index)
            if self.dist.is_main:
                path = ckpt.save_step_checkpoint(
                    self.run_dir, state, self.step_index, self.config.train.keep_checkpoints
                )
        self.saved_step = self.step_index
        return path

    def load(self, path: str | Path) -> None:
        """Restore a checkpoint written by :meth:`save` / :meth:`save_step` (every rank reads the file; it is loaded
        with ``weights_only=True`` and its checksum verified, see :mod:`palestra.engine.checkpoint`)."""
        self.load_state(ckpt.load_checkpoint(path), source=path)

    def load_state(self, state: Mapping[str, Any], *, source: str | Path = "(state)") -> None:
        """Restore a state already loaded with :func:`palestra.engine.checkpoint.load_checkpoint` from ``source``."""
        restored = ckpt.restore_state(self.components, self.learner, state, source=source)
        self.step_index = self.saved_step = restored.step
        self.finished_at_load = Path(source).name == ckpt.FINAL_NAME and restored.step >= self.config.train.steps
        if restored.run_id is not None:
            self.run_id = restored.run_id  # the resumed run is the same run: its new checkpoints carry its id
        self.reward_ema, self.bad_steps = restored.reward_ema, restored.bad_steps
        self.before = EvalResult(**restored.before) if restored.before is not None else None
        # data from the run folder: each key a log file's name inside it, refused now (one line) before any build
        self._log_sizes = ckpt.check_log_keys(self.run_dir, restored.log_sizes, source)
        self._log_source = source
        saved_async = state.get("async")
        if self.lag and isinstance(saved_async, Mapping):
            versions = saved_async.get("versions")
            if isinstance(versions, Mapping):
                self._earlier_versions = {int(v): dict(w) for v, w in versions.items()}
        self.hooks.on_checkpoint_load(run=self.run_state(), state=state)


def _with_times(metrics: dict[str, float], started: float, batch: Experience) -> dict[str, float]:
    """``metrics`` with the step's time, its overhead (the rest after the timed parts) and its token throughput."""
    elapsed = time.perf_counter() - started
    metrics["perf/overhead_s"] = max(0.0, elapsed - sum(metrics[k] for k in _TIME_PARTS))
    metrics["perf/step_s"] = elapsed
    metrics["perf/tokens_per_s"] = float(batch.completion_mask.sum()) / max(elapsed, 1e-9)
    return metrics


def _newest_checkpoint(run_dir: Path) -> str:
    """Where a run that cannot save now resumes from: its newest step checkpoint, or a fresh start."""
    saved = ckpt.list_step_checkpoints(run_dir)
    if not saved:
        return "the run has no checkpoint yet: palestra train with its config starts it again"
    return f"palestra train --resume {run_dir} continues from step {saved[-1][0]}, its newest checkpoint"
