"""Calling rewards safely.

:class:`CheckedReward` wraps every reward a config builds: it checks the inputs agree, turns whatever the
reward returned into a float32 tensor ``[B]`` and rejects anything that is not one score per row, or not
finite, with a one-line :class:`RewardError` naming the reward (its registered name and config path), the
offending row and the value.

The combinators (the built-in rewards ``weighted_sum`` and ``layered``) live in
:mod:`palestra.plugins.rewards.combinators`.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from palestra.types import HeldOutScoring, RewardOutput, Stateful

if TYPE_CHECKING:  # torch and numpy are imported when a reward is first called, so loading plugins stays fast
    import torch

__all__ = [
    "CheckedReward",
    "RewardError",
]

log = logging.getLogger("palestra.checked_reward")


class RewardError(ValueError):
    """A reward failed or returned something that is not one finite score per row. One line, naming the reward."""

    palestra_user_error = True

    def __init__(self, message: str, *, nonfinite: bool = False) -> None:
        super().__init__(" ".join(str(message).split()))
        self.nonfinite = nonfinite  # a NaN/inf score: the trainer skips the step instead of stopping


# ---- the checked call --------------------------------------------------------------------------------
class CheckedReward:
    """Calls a reward and validates its output; always returns a :class:`RewardOutput` with float32 ``[B]`` scores."""

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
        for key, given in metrics.items():
            # typed float, but a plugin may hand back a one-element tensor
            number: object = given.item() if isinstance(given, torch.Tensor) and given.numel() == 1 else given
            if isinstance(number, bool) or not isinstance(number, numbers.Real) or not math.isfinite(number):
                raise RewardError(f"{self.label}: metric {key!r} is {_snippet(number)}, expected a finite number")
            checked.metrics[key] = float(number)
        return checked

    def evaluate(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> RewardOutput:
        """Score held-out rows against the full objective; the reward's state (a curriculum's progress) is unchanged.

        A reward with its own ``evaluate`` (the combinators) decides what "full" means; any other reward is
        called on a copy, so a stateful one is not advanced by evaluation.
        """
        inner = self.reward
        target = inner.evaluate if isinstance(inner, HeldOutScoring) else copy.deepcopy(inner)
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
                raise RewardError(
                    f"{self.label}: {what} has shape {list(value.shape)}, expected [{b}] (one score per row)"
                )
            scores = value.detach().to(torch.float32)
        elif isinstance(value, (list, tuple, np.ndarray)):
            if len(value) != b:
                raise RewardError(f"{self.label}: {what} has {len(value)} scores for {b} rows (one score per row)")
            for i, v in enumerate(value):
                if (isinstance(v, torch.Tensor) and v.numel() == 1) or isinstance(v, np.generic):
                    v = v.item()
                if not isinstance(v, numbers.Real):
                    raise RewardError(
                        f"{self.label}: {what} row {i} is {_snippet(v)} ({type(v).__name__}), not a number"
                    )
            scores = torch.tensor([float(v) for v in value], dtype=torch.float32)
        else:
            raise RewardError(f"{self.label}: {what} is {type(value).__name__}, expected a float tensor of shape [{b}]")
        bad = (~torch.isfinite(scores)).nonzero()
        if bad.numel():
            row = int(bad[0, 0])
            raise RewardError(
                f"{self.label}: {what} row {row} is {scores[row].item()} "
                f"(not finite; completion {_snippet(completions[row])})",
                nonfinite=True,
            )
        return scores

    def _failing_row(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> int | None:
        """Find the first row the reward raises on by itself; its state (if any) is put back afterwards."""
        saved = copy.deepcopy(self.reward.state_dict()) if isinstance(self.reward, Stateful) else None
        try:
            for i in range(len(completions)):
                try:
                    self.reward([prompts[i]], [completions[i]], [metadata[i]])
                except Exception:  # noqa: BLE001 - whatever a plugin's reward raises, that row is the one to name
                    return i
            return None
        finally:
            if saved is not None:
                self.reward.load_state_dict(saved)

    def state_dict(self) -> dict[str, Any]:
        return self.reward.state_dict() if isinstance(self.reward, Stateful) else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if isinstance(self.reward, Stateful):
            self.reward.load_state_dict(state)
        elif state:
            raise RewardError(f"{self.label}: has no state, but the checkpoint holds {sorted(state)}")

    def __repr__(self) -> str:
        return f"CheckedReward({self.label}, {self.reward!r})"


def max_score(reward: Any) -> float | None:
    """``reward.max_score`` when it declares one (an attribute or property), else None."""
    value = getattr(reward, "max_score", None)
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


def _evaluate(
    reward: Any, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> RewardOutput:
    """A nested reward's held-out scores (see :meth:`CheckedReward.evaluate`)."""
    return (
        reward.evaluate(prompts, completions, metadata)
        if isinstance(reward, HeldOutScoring)
        else reward(prompts, completions, metadata)
    )


def _snippet(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
