"""Built-in reward combinators: ``weighted_sum`` (a joint reward) and ``layered`` (a curriculum).

* :class:`WeightedSum`: a joint reward ``sum_k w_k * r_k`` that also reports every term's scores.
* :class:`Layered`: a curriculum. Layer 0 always counts; layer ``k`` is held back (contributes nothing
  and is not even computed) until the moving average of the layer it watches reaches ``unlock_at``.
  Unlocking is permanent, and its state (moving averages, unlocked layers) is checkpointable.

Their options hold nested reward nodes, built through the registry and called through
:class:`palestra.checked_reward.CheckedReward`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from palestra import hookimpl
from palestra.checked_reward import RewardError, _evaluate, max_score
from palestra.config import OptionError, RewardSpec, check_options, option
from palestra.types import RewardOutput

if TYPE_CHECKING:
    import torch

log = logging.getLogger("palestra.plugins.rewards.combinators")


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
    for key, metric in out.metrics.items():
        metrics[f"{label}/{key}"] = metric


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
        bounds = [b for b in best if b is not None]
        if len(bounds) < len(best):
            return None
        return sum(max(0.0, w * b) for w, b in zip(self.weights, bounds))

    def state_dict(self) -> dict[str, Any]:
        return {"terms": {label: term.state_dict() for label, term in zip(self.labels, self.terms)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        terms = state.get("terms", {})
        if set(terms) != set(self.labels):
            raise RewardError(
                f"weighted_sum: the checkpoint has terms {sorted(terms)}, this config has {sorted(self.labels)}"
            )
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
            raise OptionError(
                "layers", "needs at least one reward, e.g. [{name: format}, {name: correctness, unlock_at: 0.8}]"
            )
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
            if (
                not self.unlocked[k]
                and self.unlocked[w]
                and ema is not None
                and threshold is not None
                and ema >= threshold
            ):
                self.unlocked[k] = True
                log.info(
                    "layered reward: layer %d %r unlocked after %d calls (%r moving average %.3f >= %s)",
                    k,
                    self.labels[k],
                    self.calls,
                    self.labels[w],
                    ema,
                    threshold,
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
        bounds = [b for b in best if b is not None]
        if len(bounds) < len(best):
            return None
        return sum(max(0.0, layer.weight * b) for layer, b in zip(self.options.layers, bounds))

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


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "weighted_sum",
        WeightedSum,
        options=WeightedSumOptions,
        description="sum of weighted rewards; logs every term",
    )
    register(
        "layered",
        Layered,
        options=LayeredOptions,
        description="curriculum: each layer unlocks when the moving average of the one before passes its unlock_at",
    )
