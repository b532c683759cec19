"""``tool_format``: a reward for using tools well, over the whole tool-use episode (docs/tools.md).

It reads what the tool loop puts in each reward row's metadata: ``tool_calls`` (every call of the episode, each with
its ``error``: None when the call was well formed and ran) and ``info["answered"]`` (the episode ended with an
answer, not out of calls or tokens). With ``k`` calls of which ``ok`` ran without error, and ``a`` = 1 when the
episode answered (else 0)::

    score = (format_weight * ok / k + answer_weight * a) / (format_weight + answer_weight)

so 1.0 means every call was well formed and ran, and the episode answered. An episode that answered without calling
a tool scores ``no_call_score`` (0 by default: the reward pays for tool use; set it to 1 to only punish bad calls); one
that neither called nor answered, and a row without ``tool_calls`` (a run without a ``tools:`` section), score 0.
Combine it with the task's reward in a ``weighted_sum`` (or a layer of ``layered``); it has no state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palestra import hookimpl
from palestra.config import OptionError, check_options, option

if TYPE_CHECKING:
    import torch


@dataclass
class ToolFormatOptions:
    format_weight: float = option(0.5, ge=0)  # the share of well-formed calls that ran without error
    answer_weight: float = option(0.5, ge=0)  # whether the episode answered
    no_call_score: float = option(0.0, ge=0, le=1)  # an episode that answered without calling any tool

    def __post_init__(self) -> None:
        if self.format_weight + self.answer_weight <= 0:
            raise OptionError("answer_weight", "format_weight + answer_weight must be > 0")


class ToolFormatReward:
    """In [0, 1]: well-formed calls that ran, and an answer at the end (see the module docstring)."""

    max_score = 1.0

    def __init__(self, **options: Any) -> None:
        self.options: ToolFormatOptions = check_options(ToolFormatOptions, options, where="tool_format")

    def score(self, meta: Mapping[str, Any]) -> float:
        calls = meta.get("tool_calls")
        if calls is None:
            return 0.0
        info = meta.get("info")
        answered = bool(info.get("answered")) if isinstance(info, Mapping) else False
        if not calls:
            return self.options.no_call_score if answered else 0.0
        ok = sum(1 for c in calls if not c.get("error"))
        o = self.options
        return (o.format_weight * ok / len(calls) + o.answer_weight * answered) / (o.format_weight + o.answer_weight)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        import torch

        return torch.tensor([self.score(m) for m in metadata], dtype=torch.float32)


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "tool_format",
        ToolFormatReward,
        options=ToolFormatOptions,
        description="tool use: the share of calls that were well formed and ran, and whether the episode answered",
    )
