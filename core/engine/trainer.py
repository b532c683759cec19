"""The training loop, and nothing else: rollout -> reward -> advantages -> update -> metrics, once per step.

Data flows one way (the README's architecture map): the environment makes observations, the generator samples
completions from the policy, the reward scores finished episodes, the policy optimiser turns the scored
batch into an update, and the metrics go to the loggers and the lifecycle hooks. Nothing downstream
reaches back upstream.

Determinism: the run seed fixes the initial weights, every step's tasks (a seed per step drawn from the run
seed) and every step's sampling (a ``torch.Generator`` per step), so the same seed gives the same numbers
on the same machine and thread count, and a run resumed from a checkpoint continues bitwise as if it had
never stopped (see :mod:`palestra.engine.checkpoint`).

Under torchrun (:mod:`palestra.scale.distributed`) each rank plays ``train.batch_size / world_size`` tasks from its
own seed stream, the reward scores the global batch (so a curriculum advances identically on every rank),
gradients are averaged (ddp) or reduce-scattered (fsdp), metrics are averaged, and rank 0 alone logs and
writes checkpoints. Resilience: every phase of a step runs under a :class:`~palestra.engine.watchdog.StepWatchdog`
(``train.step_timeout_s``), environment calls under ``train.data_timeout_s`` and the protocol checks of
:class:`~palestra.engine.checked_environment.CheckedEnvironment`, and a step whose reward (a row or the batch's
mean) or update is not finite is skipped with a warning; ``train.max_bad_steps`` skipped steps in a row end the
run. SIGINT and SIGTERM stop the run at the next step boundary with a checkpoint
(:class:`~palestra.engine.watchdog.StopSignals`).
"""

from __future__ import annotations

import copy
import math
import random
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from palestra.config import Config, build_component
from palestra.context import TrainContext
from palestra.engine import checkpoint as ckpt
from palestra.engine.checked_environment import CheckedEnvironment
from palestra.engine.learner import Learner
from palestra.engine.rollout import Rollout, collect
from palestra.engine.watchdog import Interrupted, StepWatchdog, StopSignals
from palestra.multiagent.credit import credit_rewards
from palestra.multiagent.sharing import wrap_policy
from palestra.plugin_manager import get_plugin_manager
from palestra.scale.distributed import DistributedContext
from palestra.types import AdapterPolicy, Experience, HeldOutSplit, SamplingParams, Stateful

__all__ = ["EvalResult", "Interrupted", "TrainResult", "Trainer", "TrainingAborted", "derive_seed"]


class TrainingAborted(RuntimeError):
    """``train.max_bad_steps`` steps in a row were skipped (non-finite reward or update). One line."""

    palestra_user_error = True


class NonFiniteStepWarning(UserWarning):
    """A step was skipped because its reward or its update was not finite."""


def derive_seed(seed: int, stream: str, index: int = 0) -> int:
    """A 63-bit seed for ``(seed, stream, index)``: independent streams (training tasks, held-out tasks, sampling)."""
    return random.Random(f"palestra/{seed}/{stream}/{index}").getrandbits(63)


@dataclass
class EvalResult:
    """Held-out reward: mean total and mean per component, over ``tasks`` tasks (greedy decoding)."""

    reward: float
    components: dict[str, float]
    tasks: int
    max_score: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"reward": self.reward, "components": dict(self.components), "tasks": self.tasks, "max_score": self.max_score}

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
    """Builds every component from a validated :class:`~palestra.config.Config`, then trains (see the module docstring)."""

    def __init__(self, config: Config, *, run_dir: str | Path | None = None) -> None:
        from palestra.kernels import set_backend

        self.config = config
        t = config.train
        seed = config.run.seed
        random.seed(seed)
        torch.manual_seed(seed)  # the policy's initial weights (the same on every rank)
        set_backend(config.kernels.backend)
        self.dist = DistributedContext.from_config(config, t.device)
        self.local_batch_size = self.dist.local_batch_size(t.batch_size)
        self.device = self.dist.device
        self.run_dir = Path(run_dir) if run_dir is not None else Path(config.run.output_dir) / config.run.name

        # Cheap components first, so a bad environment or reward stops the run before a model is loaded.
        self.env = build_component("environment", config.environment, path="environment")
        # A data set's own held-out split when it keeps one; else a second instance (evaluated on held-out seeds).
        self.eval_env = (self.env.held_out() if isinstance(self.env, HeldOutSplit)
                         else build_component("environment", config.environment, path="environment"))
        self.reward = build_component("reward", config.reward, path="reward")
        # Loggers live on rank 0 only: the other ranks' metrics reach it through the all-reduce.
        specs = config.loggers if self.dist.is_main else []
        self.loggers = [build_component("logger", spec, path=f"loggers[{i}]") for i, spec in enumerate(specs)]
        self.generator = build_component("generator", config.generator, path="generator")
        self.algorithm = build_component("optimizer", config.optimizer, path="optimizer")
        self.policy = build_component("policy", config.policy, path="policy")
        self.policy.to(device=self.device, dtype=getattr(torch, t.dtype))
        self.dist.broadcast_module(self.policy)  # identical starting weights, however the policy was made
        # multi-agent (issue 6): per-agent views sharing agents.shared_layers; unchanged when config.agents is None
        self.policy = wrap_policy(self.policy, config.agents, self.env, self.algorithm)
        self.reference = None
        if isinstance(self.policy, AdapterPolicy) and self.dist.fsdp:
            from palestra.config import ConfigError

            raise ConfigError("distributed.strategy: fsdp is not supported for a policy that trains adapters (LoRA, "
                              f"policy {config.policy.name!r}); use ddp: only the adapters' gradients are averaged")
        if self.algorithm.needs_reference:
            # LoRA: the frozen base (the policy with its adapters disabled) is the reference; no second copy
            self.reference = (self.policy.base_reference() if isinstance(self.policy, AdapterPolicy)
                              else copy.deepcopy(self.policy).eval().requires_grad_(False))
        self.dist.shard(self.policy)  # FSDP2 (distributed.strategy=fsdp); a no-op otherwise
        # Everything the optimiser needs from the run, handed over explicitly: device, ranks, precision, gradient
        # averaging, the config.
        self.context = TrainContext.for_run(config, self.dist)
        self.learner = Learner(self.algorithm, self.policy, self.context, reference=self.reference)
        self.hooks = get_plugin_manager().hook
        self.watchdog = StepWatchdog(t.step_timeout_s)
        # The environments as every step calls them: timed and checked against the protocol (built once).
        self.checked_env, self.checked_eval_env = self.checked(self.env), self.checked(self.eval_env)
        self.stop_signals = StopSignals()
        # Written into every checkpoint, so that resume never continues another run that used the same directory.
        # Rank 0's id on every rank: the checkpoints it writes and run.json agree.
        self.run_id: str = self.dist.broadcast_object(uuid.uuid4().hex)
        self.saved_step: int | None = None  # the step of the newest checkpoint written (or loaded)
        self.step = 0
        self.reward_ema: float | None = None
        self.bad_steps = 0  # consecutive skipped steps
        self.before: EvalResult | None = None  # the held-out reward before training (restored on resume)
        self._log_sizes: dict[str, int] = {}  # logged file sizes at the loaded checkpoint
        self.sampling = SamplingParams(max_new_tokens=t.max_new_tokens, temperature=t.temperature, top_p=t.top_p)

    # ---- one step --------------------------------------------------------------------------------------
    def rollout(self, step: int, refill: int = 0) -> tuple[Rollout, Experience, dict[str, float]]:
        """Sample and score one batch: ``train.batch_size`` tasks x ``train.group_size`` completions (``refill``: the
        step's n-th extra batch, with tasks and samples of its own)."""
        t, seed = self.config.train, self.config.run.seed
        # One process: the historical streams. Several: each rank its own task and sampling stream.
        stream = "" if not self.dist.enabled else f"/rank{self.dist.rank}"
        stream += f"/refill{refill}" if refill else ""
        gen = torch.Generator(device=self.device).manual_seed(derive_seed(seed, "sampling" + stream, step))
        self.policy.eval()
        started = time.perf_counter()
        # Sampling runs in the training precision too (train.precision=bf16: the decode matmuls in bf16, the sampling
        # math in fp32); any gap to the learner's log-probs this leaves is logged as rollout/* and can be corrected.
        with self.watchdog.phase("rollout"), self.dist.gathered(self.policy), self.learner.autocast():
            ro = collect(
                self.checked_env, self.policy, self.generator, self.sampling, self.local_batch_size,
                group_size=t.group_size, seed=derive_seed(seed, "tasks" + stream, step), rng=gen,
            )
        gen_s = time.perf_counter() - started
        with self.watchdog.phase("reward"):
            scored, global_mean = self.score_rows(*ro.reward_rows())
        # multi-agent (issue 6): agents.credit "role" gives each agent's rows its own turn's reward; per-agent metrics
        agent_scores, agent_metrics = None, {}
        if self.config.agents is not None:
            agent_scores, agent_metrics = credit_rewards(self.reward, ro, self.env.agent_ids, self.config.agents.credit, scored)
        reward_s = time.perf_counter() - started - gen_s
        batch = ro.experience(scored.scores, scored.components, pad_token_id=self.policy.tokenizer.pad_token_id,
                              agent_scores=agent_scores)
        mean = global_mean
        decay = t.reward_ema
        ema = mean if self.reward_ema is None else decay * self.reward_ema + (1 - decay) * mean
        components = {f"reward/{k}": _mean64(v) for k, v in scored.components.items()}
        self._check_aggregates({"reward/mean": mean, "reward/ema": ema, **components})
        self.reward_ema = ema  # only once the batch is known to be usable: a skipped step leaves it as it was
        generated = int(batch.completion_mask.sum())
        metrics = {
            "reward/mean": mean,
            "reward/ema": self.reward_ema,
            **components,
            **{f"curriculum/{k}": v for k, v in scored.metrics.items()},
            "response/length": generated / max(1, batch.batch_size),
            "perf/gen_tokens_per_s": generated / max(gen_s, 1e-9),
            "perf/generate_s": gen_s,  # the rollout: environment calls and sampling
            "perf/reward_s": reward_s,
            **agent_metrics,
        }
        best = self.reward.max_score
        if best is not None:
            metrics["reward/max"] = best
        return ro, batch, metrics

    def score_rows(self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> tuple[Any, float]:
        """The reward on this rank's rows, and the global batch's mean score.

        Under torchrun every rank scores the *global* batch (the rows of every rank, in rank order) and keeps its
        own slice: a stateful reward (a curriculum that unlocks a layer once a moving average is high enough)
        then sees exactly what one process would and moves identically on every rank.
        """
        if not self.dist.enabled:
            out = self.reward(prompts, completions, metadata)
            return out, _mean64(out.scores)
        parts = self.dist.all_gather_object((prompts, completions, metadata))
        start = sum(len(p[1]) for p in parts[: self.dist.rank])
        rows = slice(start, start + len(completions))
        out = self.reward(*([x for p in parts for x in p[i]] for i in range(3)))
        mean = _mean64(out.scores)
        out.scores = out.scores[rows]
        out.components = {k: v[rows] for k, v in out.components.items()}
        return out, mean

    def checked(self, env: Any) -> CheckedEnvironment:
        """``env`` with its calls timed (``train.data_timeout_s``, the watchdog) and checked against the protocol."""
        return CheckedEnvironment(env, name=self.config.environment.name, timeout_s=self.config.train.data_timeout_s,
                                  watchdog=self.watchdog)

    def _check_aggregates(self, means: Mapping[str, float]) -> None:
        """A batch whose rows are finite can still average to inf/NaN (rows near float32's limit): skip it like a
        non-finite row rather than log NaN and train on it."""
        from palestra.engine.checked_reward import RewardError

        bad = next(((k, v) for k, v in means.items() if not math.isfinite(v)), None)
        if bad is not None:
            raise RewardError(f"{self.reward.label}: the batch's {bad[0]} is {bad[1]} although every row is finite "
                              "(scores too large to average)", nonfinite=True)

    def train_step(self) -> dict[str, float]:
        """One rollout and one update; returns the step's metrics (also sent to the loggers and hooks)."""
        started = time.perf_counter()
        step = self.step
        self.watchdog.set_step(step)
        self.hooks.on_step_start(trainer=self, step=step)
        try:
            _, batch, metrics = self.rollout(step)
            batch = self.refilled(step, batch, metrics)
        except Exception as e:
            if not _nonfinite_reward(e):
                raise
            return self._skip(step, f"the reward is not finite ({e})", {}, started)
        self.hooks.on_rollout_end(trainer=self, step=step, batch=batch)
        self.policy.train()
        with self.watchdog.phase("update"):
            scoring = time.perf_counter()
            batch = self.learner.prepare(batch.validate())  # reference log-probs, advantages
            updating = time.perf_counter()
            metrics.update(self.learner.update(batch))
            metrics["perf/score_s"] = updating - scoring
            metrics["perf/update_s"] = time.perf_counter() - updating  # forwards, backwards, optimiser steps
        if metrics.get("train/skipped", 0.0):
            return self._skip(step, "the loss or the gradient norm is not finite", metrics, started, updated=True)
        self.bad_steps = 0
        elapsed = time.perf_counter() - started
        # The parts are disjoint intervals inside the step, so the overhead (hooks, building the batch) is the rest.
        parts = ("perf/generate_s", "perf/reward_s", "perf/score_s", "perf/update_s")
        metrics["perf/overhead_s"] = max(0.0, elapsed - sum(metrics[k] for k in parts))
        metrics["perf/step_s"] = elapsed
        metrics["perf/tokens_per_s"] = float(batch.completion_mask.sum()) / max(elapsed, 1e-9)
        metrics = self.dist.all_reduce_mean(metrics)
        self.step += 1
        self.hooks.on_optimizer_step(trainer=self, step=self.step, metrics=metrics)
        return metrics

    def refilled(self, step: int, batch: Experience, metrics: dict[str, float]) -> Experience:
        """``batch`` with more sampled groups appended while the learner lacks groups with a training signal (DAPO's
        dynamic sampling with refill), at most ``refill_rounds`` more rollouts. Every rank draws as many as the
        neediest one, so the rollouts' collectives stay in step."""
        limit = self.algorithm.refill_rounds
        if not limit:
            return batch
        rounds, short = 0, self.algorithm.groups_short(batch)
        while rounds < limit and self.dist.any_true(short > 0):
            rounds += 1
            _, more, extra = self.rollout(step, refill=rounds)
            more.group_ids = more.group_ids + int(batch.group_ids.max()) + 1  # a fresh rollout numbers groups from 0
            batch = Experience.concat([batch, more], pad_token_id=self.policy.tokenizer.pad_token_id)
            for key in ("perf/generate_s", "perf/reward_s"):  # the step's time parts stay disjoint and complete
                metrics[key] += extra[key]
            short = self.algorithm.groups_short(batch)
        metrics["rollout/refill_rounds"] = float(rounds)
        metrics["rollout/groups_short"] = float(short)
        return batch

    def _skip(self, step: int, why: str, metrics: dict[str, float], started: float, *, updated: bool = False) -> dict[str, float]:
        """Count a skipped step (no optimiser step was taken); abort after ``train.max_bad_steps`` in a row."""
        self.bad_steps += 1
        limit = self.config.train.max_bad_steps
        if self.dist.is_main:
            warnings.warn(f"step {step + 1} skipped: {why} ({self.bad_steps} in a row, limit train.max_bad_steps={limit})",
                          NonFiniteStepWarning, stacklevel=2)
        if self.bad_steps >= limit:
            raise TrainingAborted(
                f"train.max_bad_steps: {self.bad_steps} steps in a row were skipped (non-finite reward, loss or "
                f"gradient); the last, step {step + 1}: {why}"
            )
        elapsed = time.perf_counter() - started
        metrics = {**{k: v for k, v in metrics.items() if isinstance(v, float)}, "train/skipped": 1.0}
        # A phase the step never reached took no time: the parts still sum to the step time.
        parts = ("perf/generate_s", "perf/reward_s", "perf/score_s", "perf/update_s")
        metrics.update({k: metrics.get(k, 0.0) for k in parts})
        metrics["perf/overhead_s"] = max(0.0, elapsed - sum(metrics[k] for k in parts))
        metrics["perf/step_s"] = elapsed
        metrics = self.dist.all_reduce_mean(metrics) if updated else metrics
        self.step += 1
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
        with self.watchdog.phase("eval"), self.dist.gathered(self.policy), self.learner.autocast():
            ro = collect(self.checked_eval_env, self.policy, self.generator, params, n,
                         seed=derive_seed(self.config.run.seed, "held-out"))
            scored = self.reward.evaluate(*ro.reward_rows())
        comps = {k: _mean64(v) for k, v in scored.components.items()}
        return EvalResult(_mean64(scored.scores), comps, n, self.reward.max_score)

    # ---- the loop --------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Train to ``train.steps``. SIGINT/SIGTERM end it at the next step boundary, after a checkpoint, with
        :class:`Interrupted` (see :meth:`_stop_if_signalled`)."""
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # a resumed run rewrites what followed its checkpoint
            ckpt.restore_logs(self.run_dir, self._log_sizes, self.step)
        plain = self.config.to_dict()
        for logger in self.loggers:
            logger.open(self.run_dir, plain)
        started = time.perf_counter()
        history: list[dict[str, float]] = []
        metrics: dict[str, float] = {}
        self.watchdog.start()
        try:
            with self.stop_signals:
                self.hooks.on_train_start(trainer=self, config=self.config)
                if self.before is None:
                    self.before = self.evaluate()
                    self._log(self.before.metrics(), 0)
                after = self._train_steps(history)
                metrics = history[-1] if history else {}
                self.hooks.on_train_end(trainer=self, metrics=metrics)
        except Interrupted as e:
            if e.at_once:  # a second signal: say what there is to resume from
                e.saved_step, e.run_dir = self.saved_step, self.run_dir
            raise
        finally:
            self.watchdog.stop()
            for logger in self.loggers:
                logger.close()
        return TrainResult(self.before, after, metrics, self.run_dir, self.step, time.perf_counter() - started, history)

    def _train_steps(self, history: list[dict[str, float]]) -> EvalResult:
        """The steps from ``self.step`` to ``train.steps``, the final evaluation and checkpoint."""
        t = self.config.train
        while True:
            self._stop_if_signalled()
            if self.step >= t.steps:
                break
            metrics = self.train_step()
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                metrics.update(self.evaluate().metrics())
            history.append(metrics)
            if self.step % t.log_every == 0 or self.step == t.steps:
                self._log(metrics, self.step)
            if t.save_every and self.step % t.save_every == 0 and self.step < t.steps:
                self.save_step()
        after = self.evaluate()
        self._log(after.metrics(), self.step)
        self.save()
        return after

    def _stop_if_signalled(self) -> None:
        """At a step boundary: if a rank got SIGINT/SIGTERM, save this step and raise :class:`Interrupted`.

        Every rank takes part (one all-reduce of a flag per step), so all stop at the same step; the signal
        reported (and so the exit status) is rank 0's when it got one.
        """
        if not self.dist.any_true(self.stop_signals.received is not None):
            return
        signum = next(s for s in self.dist.all_gather_object(self.stop_signals.received) if s is not None)
        if self.saved_step != self.step:
            self.save_step()
        raise Interrupted(signum, saved_step=self.step, run_dir=self.run_dir)

    def _log(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        for logger in self.loggers:
            logger.log(clean, step)

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a run needs to continue bitwise: weights, optimiser (+ scaler, replay buffer, running reward
        statistics), every rank's RNG states, step, reward curriculum, reward EMA, environment state (when it has
        one), the held-out reward before training, and the logged files' sizes.

        Collective under torchrun (every rank must call it: RNG states are gathered, FSDP gathers full tensors);
        the complete state is meaningful on rank 0.
        """
        algorithm = self.learner.state_dict()  # collective under FSDP: the full optimiser states
        adapters = isinstance(self.policy, AdapterPolicy)
        if adapters:  # LoRA: the trainable tensors only; resume rebuilds the frozen base from its model files
            policy = self.policy.adapter_state_dict()
        elif self.dist.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            policy = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            policy = self.policy.state_dict()
        state: dict[str, Any] = {
            "format": ckpt.FORMAT,
            "run_id": self.run_id,
            "step": self.step,
            "policy": policy,
            "policy_adapters": adapters,  # "policy" holds only the adapters (and value head) of a LoRA policy
            "optimizer": algorithm,
            "reward": self.reward.state_dict(),
            "reward_ema": self.reward_ema,
            "bad_steps": self.bad_steps,
            "before": self.before.to_dict() if self.before is not None else None,
            "env": self.env.state_dict() if isinstance(self.env, Stateful) else None,
            "rng": self.dist.all_gather_object(ckpt.capture_rng()),
            "world_size": self.dist.world_size,
            "logs": ckpt.log_sizes(self.loggers, self.run_dir),
            "config": self.config.to_dict(),
        }
        self.hooks.on_checkpoint_save(trainer=self, step=self.step, state=state)
        return state

    def save(self, path: str | Path | None = None) -> Path:
        """Write the final checkpoint (``RUN_DIR/checkpoint.pt``, or ``path``) atomically: a temporary file in the same
        folder, fsynced, then renamed over the target. Under torchrun every rank calls it and rank 0 writes."""
        target = Path(path) if path is not None else self.run_dir / ckpt.FINAL_NAME
        with self.watchdog.phase("checkpoint"):
            state = self.state_dict()
            if self.dist.is_main:
                ckpt.save_checkpoint(state, target)
        self.saved_step = self.step
        return target

    def save_step(self) -> Path:
        """Write ``RUN_DIR/checkpoints/step-NNNNNN.pt`` atomically, point ``latest`` at it, keep the newest
        ``train.keep_checkpoints``."""
        with self.watchdog.phase("checkpoint"):
            state = self.state_dict()
            path = self.run_dir / ckpt.CHECKPOINT_DIR / ckpt.step_name(self.step)
            if self.dist.is_main:
                path = ckpt.save_step_checkpoint(self.run_dir, state, self.step, self.config.train.keep_checkpoints)
        self.saved_step = self.step
        return path

    def load(self, path: str | Path) -> None:
        """Restore a checkpoint written by :meth:`save` / :meth:`save_step` (every rank reads the file; it is loaded
        with ``weights_only=True`` and its checksum verified, see :mod:`palestra.engine.checkpoint`)."""
        self.load_state(ckpt.load_checkpoint(path), source=path)

    def load_state(self, state: Mapping[str, Any], *, source: str | Path = "(state)") -> None:
        """Restore a state already loaded with :func:`palestra.engine.checkpoint.load_checkpoint` from ``source``."""
        self._check_policy_kind(bool(state.get("policy_adapters", False)), source)
        try:
            self._load_policy(state["policy"])
        except (RuntimeError, KeyError, ValueError) as e:  # torch reports a mismatch as a page of size mismatches
            mismatch = self._policy_mismatch(state["policy"], source)
            if mismatch is None:  # the names and shapes agree: not the user's checkpoint, a fault to show in full
                raise
            raise ckpt.CheckpointError(mismatch) from e
        self.learner.load_state_dict(state["optimizer"])  # FSDP: the learner scatters the full optimiser states
        self.reward.load_state_dict(state["reward"])
        self.reward_ema = state["reward_ema"]
        self.step = int(state["step"])
        self.saved_step = self.step
        if isinstance(state.get("run_id"), str):
            self.run_id = state["run_id"]  # the resumed run is the same run: its new checkpoints carry its id
        self.bad_steps = int(state.get("bad_steps", 0))
        before = state.get("before")
        self.before = EvalResult(**before) if before is not None else None
        if state.get("env") is not None and isinstance(self.env, Stateful):
            self.env.load_state_dict(state["env"])
        self._log_sizes = dict(state.get("logs") or {})
        rng = state.get("rng") or []
        if len(rng) == self.dist.world_size:  # another world size: RNG streams cannot match anyway
            ckpt.restore_rng(rng[self.dist.rank])
        elif self.dist.is_main:
            warnings.warn(f"checkpoint {source}: saved by {len(rng)} rank(s), resumed on {self.dist.world_size}; "
                          "random states start fresh", stacklevel=2)
        self.hooks.on_checkpoint_load(trainer=self, step=self.step, state=state)

    def _check_policy_kind(self, saved_adapters: bool, source: str | Path) -> None:
        """One line when the checkpoint holds adapters only and the policy trains every weight, or the other way."""
        live_adapters = isinstance(self.policy, AdapterPolicy)
        if saved_adapters != live_adapters:
            saved, live = ("only LoRA adapters", "trains every weight") if saved_adapters else ("every weight", "trains LoRA adapters")
            raise ckpt.CheckpointError(f"checkpoint {source} holds {saved} but the policy built from its config "
                                       f"(policy {self.config.policy.name!r}, policy.options.lora) {live}")

    def _load_policy(self, weights: Mapping[str, Any]) -> None:
        if isinstance(self.policy, AdapterPolicy):  # the frozen base was loaded from its files when the policy was built
            self.policy.load_adapter_state_dict(weights)
        elif self.dist.fsdp:
            from palestra.scale.distributed import load_full_state_dict

            load_full_state_dict(self.policy, weights)
        else:
            self.policy.load_state_dict(weights)

    def _policy_mismatch(self, saved: Mapping[str, Any], source: str | Path) -> str | None:
        """One line naming the first parameter whose name or shape differs between the checkpoint and the policy its
        config built; None when they agree."""
        where = f"checkpoint {source} does not fit the policy built from its config (policy {self.config.policy.name!r}, policy.options)"
        # FSDP: DTensors, whose shapes are the full ones; LoRA: the adapters, all a checkpoint holds
        live = self.policy.adapter_state_dict() if isinstance(self.policy, AdapterPolicy) else self.policy.state_dict()
        for name, value in live.items():
            if not isinstance(value, torch.Tensor):
                continue
            if name not in saved:
                return f"{where}: parameter {name!r} {list(value.shape)} is not in the checkpoint"
            stored = saved[name]
            if isinstance(stored, torch.Tensor) and stored.shape != value.shape:
                return f"{where}: parameter {name!r} is {list(stored.shape)} in the checkpoint and {list(value.shape)} in the policy"
        extra = next((k for k in saved if k not in live), None)
        if extra is not None:
            return f"{where}: the checkpoint has parameter {extra!r}, which the policy does not"
        return None


def _mean64(values: torch.Tensor) -> float:
    """The mean of ``values`` in float64: float32 scores near its limit (3e38) would overflow a float32 sum."""
    return float(values.detach().to(torch.float64).mean())


def _nonfinite_reward(e: BaseException) -> bool:
    """True for the reward wrapper's one-line error about a NaN/inf score (the step is skipped, not fatal)."""
    from palestra.engine.checked_reward import RewardError

    return isinstance(e, RewardError) and e.nonfinite
