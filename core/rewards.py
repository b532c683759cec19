"""Calling rewards safely, and combining them.

:class:`CheckedReward` wraps every reward a config builds: it checks the inputs agree, turns whatever the
reward returned into a float32 tensor ``[B]`` and rejects anything that is not one score per row, or not
finite, with a one-line :class:`RewardError` naming the reward (its registered name and config path), the
offending row and the value.

Combinators (registered as the built-in rewards ``weighted_sum`` and ``layered``):

* :class:`WeightedSum`: a joint reward ``sum_k w_k * r_k`` that also reports every term's scores.
* :class:`Layered`: a curriculum. Layer 0 always counts; layer ``k`` is held back (contributes nothing
  and is not even computed) until the moving average of the layer it watches reaches ``unlock_at``.
  Unlocking is permanent, and its state (moving averages, unlocked layers) is checkpointable.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .config import OptionError, RewardSpec, check_options, option
from .types import RewardOutput

if TYPE_CHECKING:  # torch and numpy are imported when a reward is first called, so loading plugins stays fast
    import torch

__all__ = [
    "CheckedReward",
    "Layer",
    "Layered",
    "LayeredOptions",
    "RewardError",
    "WeightedComponent",
    "WeightedSum",
    "WeightedSumOptions",
]

log = logging.getLogger("palestra.rewards")


class RewardError(ValueError):
    """A reward failed or returned something that is not one finite score per row. One line, naming the reward."""

    palestra_user_error = True

    def __init__(self, message: str, *, nonfinite: bool = False) -> None:
        super().__init__(" ".join(str(message).split()))
        self.nonfinite = nonfinite  # a NaN/inf score: the trainer skips the step instead of stopping


# ---- the checked call --------------------------------------------------------------------------------
class CheckedReward:
    """Calls a reward and validates what it returns; always returns a :class:`RewardOutput` with float32 ``[B]`` scores."""

    def __init__(self, reward: Any, *, name: str, path: str | None = None) -> None:
        if not callable(reward):
            raise TypeError(f"reward {name!r}: {type(reward).__name__} is not callable")
        self.reward, self.name, self.path = reward, name, path

    @property
    def label(self) -> str:
        return f"reward {self.name!r}" + (f" ({self.path})" if self.path and self.path != self.name else "")

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> RewardOutput:
        import torch

        b = len(completions)
        if metadata is None:
            metadata = [{} for _ in range(b)]
        if len(prompts) != b or len(metadata) != b:
            raise RewardError(
                f"{self.label}: got {len(prompts)} prompts, {b} completions and {len(metadata)} metadata rows; "
                "they must have one entry per row"
            )
        for i, c in enumerate(completions):
            if not isinstance(c, str):
                raise RewardError(f"{self.label}: completion {i} is {type(c).__name__}, expected str")
        try:
            out = self.reward(prompts, completions, metadata)
        except RewardError:
            raise  # a nested reward already said who failed
        except Exception as e:
            row = self._failing_row(prompts, completions, metadata) if b > 1 else 0
            where = f" on row {row} (completion {_snippet(completions[row])})" if row is not None else ""
            raise RewardError(f"{self.label} raised{where}: {type(e).__name__}: {e}") from e
        if isinstance(out, RewardOutput):
            scores, components, metrics = out.scores, out.components, out.metrics
        else:
            scores, components, metrics = out, {}, {}
        checked = RewardOutput(self._scores(scores, b, "output", completions))
        for key, value in components.items():
            checked.components[key] = self._scores(value, b, f"component {key!r}", completions)
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RewardError(f"{self.label}: metric {key!r} is {_snippet(value)}, expected a finite number")
            checked.metrics[key] = float(value)
        return checked

    def evaluate(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> RewardOutput:
        """Score held-out rows against the full objective, leaving the reward's state (a curriculum's progress) unchanged.

        A reward with its own ``evaluate`` (the combinators) decides what "full" means; any other reward is
        called on a copy, so a stateful one is not advanced by evaluation.
        """
        inner = self.reward
        target = inner.evaluate if hasattr(inner, "evaluate") else copy.deepcopy(inner)
        return CheckedReward(target, name=self.name, path=self.path)(prompts, completions, metadata)

    @property
    def max_score(self) -> float | None:
        """The best score a row can get (None when the reward does not say)."""
        return max_score(self.reward)

    def _scores(self, value: Any, b: int, what: str, completions: Sequence[str]) -> torch.Tensor:
        import numpy as np
        import torch

        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor):
            if value.dtype.is_complex:
                raise RewardError(f"{self.label}: {what} has dtype {value.dtype}, expected real numbers")
            if tuple(value.shape) != (b,):
                raise RewardError(f"{self.label}: {what} has shape {list(value.shape)}, expected [{b}] (one score per row)")
            scores = value.detach().to(torch.float32)
        elif isinstance(value, (list, tuple, np.ndarray)):
            if len(value) != b:
                raise RewardError(f"{self.label}: {what} has {len(value)} scores for {b} rows (one score per row)")
            for i, v in enumerate(value):
                if (isinstance(v, torch.Tensor) and v.numel() == 1) or isinstance(v, np.generic):
                    v = v.item()
                if not isinstance(v, numbers.Real):
                    raise RewardError(f"{self.label}: {what} row {i} is {_snippet(v)} ({type(v).__name__}), not a number")
            scores = torch.tensor([float(v) for v in value], dtype=torch.float32)
        else:
            raise RewardError(f"{self.label}: {what} is {type(value).__name__}, expected a float tensor of shape [{b}]")
        bad = (~torch.isfinite(scores)).nonzero()
        if bad.numel():
            row = int(bad[0, 0])
            raise RewardError(
                f"{self.label}: {what} row {row} is {scores[row].item()} (not finite; completion {_snippet(completions[row])})",
                nonfinite=True,
            )
        return scores

    def _failing_row(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> int | None:
        """Find the first row the reward raises on by itself; its state (if any) is put back afterwards."""
        saved = copy.deepcopy(self.reward.state_dict()) if hasattr(self.reward, "state_dict") else None
        try:
            for i in range(len(completions)):
                try:
                    self.reward([prompts[i]], [completions[i]], [metadata[i]])
                except Exception:
                    return i
            return None
        finally:
            if saved is not None:
                self.reward.load_state_dict(saved)

    def state_dict(self) -> dict[str, Any]:
        return self.reward.state_dict() if hasattr(self.reward, "state_dict") else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if hasattr(self.reward, "load_state_dict"):
            self.reward.load_state_dict(state)
        elif state:
            raise RewardError(f"{self.label}: has no state, but the checkpoint holds {sorted(state)}")

    def __repr__(self) -> str:
        return f"CheckedReward({self.label}, {self.reward!r})"


def max_score(reward: Any) -> float | None:
    """``reward.max_score`` when it declares one (an attribute or property), else None."""
    value = getattr(reward, "max_score", None)
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


def _evaluate(reward: Any, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
    """A nested reward's held-out scores (see :meth:`CheckedReward.evaluate`)."""
    return reward.evaluate(prompts, completions, metadata) if hasattr(reward, "evaluate") else reward(prompts, completions, metadata)


def _snippet(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _labels(parts: Sequence[RewardSpec], field_name: str) -> list[str]:
    labels = [getattr(p, "label", None) or p.name for p in parts]
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        if label in seen:
            raise OptionError(
                f"{field_name}[{i}].label",
                f"{field_name}[{seen[label]}] is also called {label!r}; give them distinct labels",
            )
        seen[label] = i
    return labels


def _scores_of(out: RewardOutput, label: str, components: dict[str, torch.Tensor], metrics: dict[str, float]) -> None:
    components[label] = out.scores
    for key, value in out.components.items():
        components[f"{label}/{key}"] = value
    for key, value in out.metrics.items():
        metrics[f"{label}/{key}"] = value


# ---- weighted sum ------------------------------------------------------------------------------------
@dataclass
class WeightedComponent(RewardSpec):
    """One term of a weighted sum: a reward node plus its weight (negative for a penalty) and a log label."""

    weight: float = 1.0
    label: str | None = None  # defaults to the reward's name


@dataclass
class WeightedSumOptions:
    components: list[WeightedComponent] = field(default_factory=list)
    normalize: bool = False  # divide by the sum of |weights|, keeping the total in the terms' range

    def __post_init__(self) -> None:
        if not self.components:
            raise OptionError("components", "needs at least one reward, e.g. [{name: correctness, weight: 1.0}]")
        _labels(self.components, "components")
        if self.normalize and sum(abs(c.weight) for c in self.components) == 0:
            raise OptionError("normalize", "the weights sum to zero, so they cannot be normalized")


class WeightedSum:
    """``sum_k w_k * r_k``; every term's unweighted scores are reported as components (by label)."""

    def __init__(self, **options: Any) -> None:
        self.options: WeightedSumOptions = check_options(WeightedSumOptions, options, where="weighted_sum")
        self.labels = _labels(self.options.components, "components")
        self.weights = [c.weight for c in self.options.components]
        if self.options.normalize:
            norm = sum(abs(w) for w in self.weights)
            self.weights = [w / norm for w in self.weights]
        self.terms = [c.build() for c in self.options.components]

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        components: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        total: torch.Tensor | None = None
        for label, weight, term in zip(self.labels, self.weights, self.terms):
            out = term(prompts, completions, metadata)
            _scores_of(out, label, components, metrics)
            total = weight * out.scores if total is None else total + weight * out.scores
        assert total is not None
        return RewardOutput(total, components, metrics)

    def evaluate(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        components: dict[str, torch.Tensor] = {}
        total: torch.Tensor | None = None
        for label, weight, term in zip(self.labels, self.weights, self.terms):
            out = _evaluate(term, prompts, completions, metadata)
            _scores_of(out, label, components, {})
            total = weight * out.scores if total is None else total + weight * out.scores
        assert total is not None
        return RewardOutput(total, components)

    @property
    def max_score(self) -> float | None:
        """Each positive term at its best and each penalty at zero (None if a term does not declare its maximum)."""
        best = [max_score(t) for t in self.terms]
        if any(b is None for b in best):
            return None
        return sum(max(0.0, w * b) for w, b in zip(self.weights, best))  # type: ignore[operator]

    def state_dict(self) -> dict[str, Any]:
        return {"terms": {label: term.state_dict() for label, term in zip(self.labels, self.terms)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        terms = state.get("terms", {})
        if set(terms) != set(self.labels):
            raise RewardError(f"weighted_sum: the checkpoint has terms {sorted(terms)}, this config has {sorted(self.labels)}")
        for label, term in zip(self.labels, self.terms):
            term.load_state_dict(terms[label])


# ---- layered curriculum ------------------------------------------------------------------------------
@dataclass
class Layer(RewardSpec):
    """One curriculum layer: a reward node, when it unlocks, its weight and its log label."""

    unlock_at: float | None = None  # unlock once the watched layer's moving average reaches this (not for layer 0)
    weight: float = 1.0
    label: str | None = None  # defaults to the reward's name


@dataclass
class LayeredOptions:
    layers: list[Layer] = field(default_factory=list)
    ema_decay: float = option(0.9, ge=0, lt=1)  # moving average from 0: ema = decay * ema + (1 - decay) * batch mean
    watch: Literal["previous", "first"] = "previous"  # layer k watches layer k-1, or always layer 0 (the basic one)
    gate_rows: bool = False  # an unlocked layer also counts only on rows where the watched layer scored >= unlock_at

    def __post_init__(self) -> None:
        if not self.layers:
            raise OptionError("layers", "needs at least one reward, e.g. [{name: format}, {name: correctness, unlock_at: 0.8}]")
        if self.layers[0].unlock_at is not None:
            raise OptionError("layers[0].unlock_at", "the first layer is always active; remove unlock_at")
        for k, layer in enumerate(self.layers[1:], start=1):
            if layer.unlock_at is None:
                raise OptionError(f"layers[{k}].unlock_at", "required for every layer after the first")
        _labels(self.layers, "layers")


class Layered:
    """A curriculum of rewards (see the module docstring). ``state_dict`` holds its progress for checkpoints.

    Each call scores the active layers, updates their moving averages with the batch means, then unlocks
    any layer whose watched layer's average reached its ``unlock_at``; a layer unlocked by a call counts
    from the next call. Metrics: ``active_layers`` and, per layer label, ``<label>/active`` and ``<label>/ema``.
    """

    def __init__(self, **options: Any) -> None:
        self.options: LayeredOptions = check_options(LayeredOptions, options, where="layered")
        self.labels = _labels(self.options.layers, "layers")
        self.rewards = [layer.build() for layer in self.options.layers]
        n = len(self.rewards)
        self.ema: list[float | None] = [None] * n
        self.unlocked = [True] + [False] * (n - 1)
        self.calls = 0

    def watched(self, k: int) -> int:
        return 0 if self.options.watch == "first" else k - 1

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        components: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        outputs = {
            k: reward(prompts, completions, metadata) for k, reward in enumerate(self.rewards) if self.unlocked[k]
        }
        total = self._weighted(outputs, components, metrics)
        scores = {k: out.scores for k, out in outputs.items()}
        self._update(scores)
        for k, label in enumerate(self.labels):
            metrics[f"{label}/active"] = float(self.unlocked[k])
            if self.ema[k] is not None:
                metrics[f"{label}/ema"] = float(self.ema[k])  # type: ignore[arg-type]
        metrics["active_layers"] = float(sum(self.unlocked))
        return RewardOutput(total, components, metrics)

    def _update(self, scores: Mapping[int, torch.Tensor]) -> None:
        self.calls += 1
        decay = self.options.ema_decay
        for k, s in scores.items():
            mean = float(s.float().mean())
            prev = self.ema[k]
            # Starting from 0 (not from the first mean) means one lucky batch cannot unlock the next layer.
            self.ema[k] = decay * (prev or 0.0) + (1 - decay) * mean
        for k in range(1, len(self.rewards)):
            w = self.watched(k)
            threshold = self.options.layers[k].unlock_at
            ema = self.ema[w]
            if not self.unlocked[k] and self.unlocked[w] and ema is not None and threshold is not None and ema >= threshold:
                self.unlocked[k] = True
                log.info(
                    "layered reward: layer %d %r unlocked after %d calls (%r moving average %.3f >= %s)",
                    k, self.labels[k], self.calls, self.labels[w], ema, threshold,
                )

    def evaluate(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        """Every layer counts, locked or not (the curriculum's goal), and nothing is updated."""
        components: dict[str, torch.Tensor] = {}
        outputs = {k: _evaluate(reward, prompts, completions, metadata) for k, reward in enumerate(self.rewards)}
        return RewardOutput(self._weighted(outputs, components, {}), components)

    def _weighted(
        self, outputs: Mapping[int, RewardOutput], components: dict[str, torch.Tensor], metrics: dict[str, float]
    ) -> torch.Tensor:
        """``sum_k weight_k * score_k`` over the scored layers (gated by row when ``gate_rows``); records components."""
        total: torch.Tensor | None = None
        for k, out in outputs.items():
            layer = self.options.layers[k]
            _scores_of(out, self.labels[k], components, metrics)
            counted = out.scores
            if k > 0 and self.options.gate_rows:
                assert layer.unlock_at is not None
                counted = counted * (outputs[self.watched(k)].scores >= layer.unlock_at).to(counted.dtype)
            total = layer.weight * counted if total is None else total + layer.weight * counted
        assert total is not None
        return total

    @property
    def max_score(self) -> float | None:
        best = [max_score(r) for r in self.rewards]
        if any(b is None for b in best):
            return None
        return sum(max(0.0, layer.weight * b) for layer, b in zip(self.options.layers, best))  # type: ignore[operator]

    @property
    def active(self) -> list[str]:
        """Labels of the layers that currently count."""
        return [label for label, on in zip(self.labels, self.unlocked) if on]

    def state_dict(self) -> dict[str, Any]:
        return {
            "labels": list(self.labels),
            "ema": list(self.ema),
            "unlocked": list(self.unlocked),
            "calls": self.calls,
            "layers": [r.state_dict() for r in self.rewards],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        labels = list(state.get("labels", []))
        if labels != self.labels:
            raise RewardError(f"layered: the checkpoint was saved for layers {labels}, this config has {self.labels}")
        ema, unlocked = list(state["ema"]), [bool(u) for u in state["unlocked"]]
        if len(ema) != len(labels) or len(unlocked) != len(labels) or not unlocked[0]:
            raise RewardError(f"layered: malformed checkpoint state (ema={ema}, unlocked={unlocked})")
        self.ema = [None if e is None else float(e) for e in ema]
        self.unlocked = unlocked
        self.calls = int(state.get("calls", 0))
        for reward, sub in zip(self.rewards, state.get("layers", [{}] * len(self.rewards))):
            reward.load_state_dict(sub)
