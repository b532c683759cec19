"""The training loop, and nothing else: rollout -> reward -> advantages -> update -> metrics, once per step.

Data flows one way (see ARCHITECTURE.md): the environment makes observations, the generator samples
completions from the policy, the reward scores finished episodes, the policy optimiser turns the scored
batch into an update, and the metrics go to the loggers and the lifecycle hooks. Nothing downstream
reaches back upstream.

Determinism: the run seed fixes the initial weights, every step's tasks (a seed per step drawn from the run
seed) and every step's sampling (a ``torch.Generator`` per step), so the same seed gives the same numbers
on the same machine and thread count.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import Config, build_component
from .plugin_manager import get_plugin_manager
from .rollout import Rollout, collect
from .types import Experience, SamplingParams

__all__ = ["EvalResult", "TrainResult", "Trainer", "derive_seed"]


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
        torch.manual_seed(seed)  # the policy's initial weights
        set_backend(config.kernels.backend)
        self.device = torch.device(t.device if t.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.run_dir = Path(run_dir) if run_dir is not None else Path(config.run.output_dir) / config.run.name

        # Cheap components first, so a bad environment or reward stops the run before a model is loaded.
        self.env = build_component("environment", config.environment, path="environment")
        self.eval_env = build_component("environment", config.environment, path="environment")
        self.reward = build_component("reward", config.reward, path="reward")
        self.loggers = [build_component("logger", spec, path=f"loggers[{i}]") for i, spec in enumerate(config.loggers)]
        self.generator = build_component("generator", config.generator, path="generator")
        self.algorithm = build_component("optimizer", config.optimizer, path="optimizer")
        self.policy = build_component("policy", config.policy, path="policy")
        self.policy.to(device=self.device, dtype=getattr(torch, t.dtype))
        self.reference = None
        if getattr(self.algorithm, "needs_reference", False):
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.algorithm.setup(self.policy, t, reference=self.reference)
        self.hooks = get_plugin_manager().hook
        self.step = 0
        self.reward_ema: float | None = None
        self.sampling = SamplingParams(max_new_tokens=t.max_new_tokens, temperature=t.temperature, top_p=t.top_p)

    # ---- one step --------------------------------------------------------------------------------------
    def rollout(self, step: int) -> tuple[Rollout, Experience, dict[str, float]]:
        """Sample and score one batch: ``train.batch_size`` tasks x ``train.group_size`` completions."""
        t, seed = self.config.train, self.config.run.seed
        gen = torch.Generator(device=self.device).manual_seed(derive_seed(seed, "sampling", step))
        self.policy.eval()
        started = time.perf_counter()
        ro = collect(
            self.env, self.policy, self.generator, self.sampling, t.batch_size,
            group_size=t.group_size, seed=derive_seed(seed, "tasks", step), rng=gen,
        )
        gen_s = time.perf_counter() - started
        scored = self.reward(*ro.reward_rows())
        batch = ro.experience(scored.scores, scored.components, pad_token_id=self.policy.tokenizer.pad_token_id)
        mean = float(scored.scores.mean())
        decay = t.reward_ema
        self.reward_ema = mean if self.reward_ema is None else decay * self.reward_ema + (1 - decay) * mean
        generated = int(batch.completion_mask.sum())
        metrics = {
            "reward/mean": mean,
            "reward/ema": self.reward_ema,
            **{f"reward/{k}": float(v.float().mean()) for k, v in scored.components.items()},
            **{f"curriculum/{k}": v for k, v in scored.metrics.items()},
            "response/length": generated / max(1, batch.batch_size),
            "perf/gen_tokens_per_s": generated / max(gen_s, 1e-9),
        }
        best = self.reward.max_score
        if best is not None:
            metrics["reward/max"] = best
        return ro, batch, metrics

    def train_step(self) -> dict[str, float]:
        """One rollout and one update; returns the step's metrics (also sent to the loggers and hooks)."""
        started = time.perf_counter()
        step = self.step
        _, batch, metrics = self.rollout(step)
        self.hooks.on_rollout_end(trainer=self, step=step, batch=batch)
        self.policy.train()
        batch = self.algorithm.prepare(batch.validate())
        metrics.update(self.algorithm.update(self.policy, batch))
        elapsed = time.perf_counter() - started
        metrics["perf/step_s"] = elapsed
        metrics["perf/tokens_per_s"] = float(batch.completion_mask.sum()) / max(elapsed, 1e-9)
        self.step += 1
        self.hooks.on_optimizer_step(trainer=self, step=self.step, metrics=metrics)
        return metrics

    # ---- evaluation --------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, tasks: int | None = None) -> EvalResult:
        """Held-out reward with greedy decoding on tasks drawn from a seed stream training never uses."""
        t = self.config.train
        n = tasks or t.eval_size
        self.policy.eval()
        params = SamplingParams(max_new_tokens=t.max_new_tokens, temperature=0.0)
        ro = collect(self.eval_env, self.policy, self.generator, params, n, seed=derive_seed(self.config.run.seed, "held-out"))
        scored = self.reward.evaluate(*ro.reward_rows())
        comps = {k: float(v.float().mean()) for k, v in scored.components.items()}
        return EvalResult(float(scored.scores.mean()), comps, n, self.reward.max_score)

    # ---- the loop --------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        t = self.config.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        plain = self.config.to_dict()
        for logger in self.loggers:
            if hasattr(logger, "open"):
                logger.open(self.run_dir, plain)
        started = time.perf_counter()
        history: list[dict[str, float]] = []
        metrics: dict[str, float] = {}
        try:
            self.hooks.on_train_start(trainer=self, config=self.config)
            before = self.evaluate()
            self._log(before.metrics(), 0)
            while self.step < t.steps:
                metrics = self.train_step()
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                    metrics.update(self.evaluate().metrics())
                history.append(metrics)
                if self.step % t.log_every == 0 or self.step == t.steps:
                    self._log(metrics, self.step)
                if t.save_every and self.step % t.save_every == 0:
                    self.save()
            after = self.evaluate()
            self._log(after.metrics(), self.step)
            self.save()
            self.hooks.on_train_end(trainer=self, metrics=metrics)
        finally:
            for logger in self.loggers:
                logger.close()
        return TrainResult(before, after, metrics, self.run_dir, self.step, time.perf_counter() - started, history)

    def _log(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        for logger in self.loggers:
            logger.log(clean, step)

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": self.step,
            "policy": self.policy.state_dict(),
            "optimizer": self.algorithm.state_dict(),
            "reward": self.reward.state_dict(),
            "reward_ema": self.reward_ema,
            "config": self.config.to_dict(),
        }
        self.hooks.on_checkpoint_save(trainer=self, step=self.step, state=state)
        return state

    def save(self, path: str | Path | None = None) -> Path:
        """Write a checkpoint atomically: to a temporary file in the same folder, then renamed over the target."""
        target = Path(path) if path is not None else self.run_dir / "checkpoint.pt"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            torch.save(self.state_dict(), tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return target
