"""A multi-turn episode as one token sequence: the prompt, the agent's turns, and the messages between them.

Per-turn rows re-encode the whole history at every turn, so a ``T``-turn episode costs the update about ``T``
times its tokens, and what the model is trained on is a re-encoding of text it decoded: a tokenizer need not give the
sampled ids back. Here the rollout keeps every episode's ids as it goes. Turn ``k + 1``'s prompt is turn ``k``'s
prompt ids, then the ids turn ``k`` sampled (its end token included), then the ids of the text the environment put
between the turns. The update trains one row per episode, with the loss on the sampled ids only. So the tokens
trained are exactly the tokens sampled, and the behaviour log-probs are those of the same positions.

The text between turns is what the policy's rendering of the next observation adds after the previous rendering and
the completion (:func:`continuation_ids`). That needs a prompt that *extends* the last one: true for plain-text
prompts that an environment appends to, and for a prefix-preserving chat template. Where an episode's next prompt
does not extend its last, that episode falls back to per-turn rows (said once).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from palestra.types import Generation, Observation

if TYPE_CHECKING:
    import torch

__all__ = ["SequenceRecord", "Trajectories", "continuation_ids"]


@dataclass
class SequenceRecord:
    """One episode's ids so far: ``ids[:prompt_len]`` is the first prompt; ``sampled[i]`` marks the ids the policy
    sampled (the loss covers those), with their behaviour log-probs in ``logprobs[i]`` (0 elsewhere)."""

    ids: list[int]
    prompt_len: int
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def extend(self, ids: Sequence[int], *, sampled: bool, logprobs: Sequence[float] | None = None) -> None:
        self.ids.extend(int(i) for i in ids)
        self.sampled.extend([sampled] * len(ids))
        self.logprobs.extend([float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids))

    def tensors(self, device: Any) -> tuple[torch.Tensor, ...]:
        """``(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs)``, each one row."""
        import torch

        p = self.prompt_len
        # up to the last sampled id: text after it (an episode ended by the token budget) is neither trained nor read
        end = max((i + 1 for i, s in enumerate(self.sampled) if s), default=p)
        prompt = torch.tensor([self.ids[:p]], dtype=torch.int64, device=device)
        rest = torch.tensor([self.ids[p:end]], dtype=torch.int64, device=device)
        return (
            prompt,
            torch.ones_like(prompt, dtype=torch.bool),
            rest,
            torch.tensor([self.sampled[p:end]], dtype=torch.bool, device=device),
            torch.tensor([self.logprobs[p:end]], dtype=torch.float32, device=device),
        )


def continuation_ids(
    policy: Any, previous: Observation, completion: str, end_token: int | None, following: Observation
) -> list[int] | None:
    """The ids that follow turn ``previous``'s sampled ids to make ``following``'s prompt; None when ``following``'s
    prompt text does not extend ``previous``'s plus ``completion`` (the template re-rendered an earlier turn).

    ``end_token`` is the token that ended the turn (an EOS or stop token, sampled and kept), or None (a stop string or
    the length limit ended it). The text it stands for in the rendering (``<|im_end|>``) is already in the sequence,
    so it is dropped from the text that follows."""
    head = policy.prompt_text(previous) + completion
    full = policy.prompt_text(following)
    if not full.startswith(head):
        return None
    rest = full[len(head) :]
    if end_token is not None:
        end = policy.token_text(end_token)
        if end and rest.startswith(end):
            rest = rest[len(end) :]
    return list(policy.tokenizer.encode(rest)) if rest else []


class Trajectories:
    """The sequences of a rollout's episodes, kept by :func:`palestra.engine.rollout.collect` (module docstring).

    ``records[e]`` is episode ``e``'s sequence, or None once it fell back to per-turn rows. ``max_tokens`` caps a
    sequence: an episode whose sequence reaches it ends (truncated) before its next turn, and a turn is never allowed
    more new tokens than the cap leaves.
    """

    def __init__(self, policy: Any, rows: int, *, end_ids: Sequence[int], max_tokens: int | None = None) -> None:
        self.policy, self.max_tokens = policy, max_tokens
        self.end_ids = {int(i) for i in end_ids}
        self.records: list[SequenceRecord | None] = [None] * rows
        self.started = [False] * rows
        self._last: dict[int, tuple[Observation, str, int | None]] = {}  # row -> (its observation, text, end token)
        self._warned = False

    def prepare(self, rows: Sequence[int], observations: Sequence[Observation]) -> list[Observation]:
        """The observations to generate from: a continuing episode's observation with its sequence as the exact
        prompt ids, and its turn capped by what ``max_tokens`` leaves."""
        out = []
        for row, obs in zip(rows, observations):
            record = self.records[row]
            if not self.started[row] or record is None:
                out.append(obs)
                continue
            cap = obs.max_new_tokens
            if self.max_tokens is not None:
                left = max(1, self.max_tokens - len(record.ids))
                cap = left if cap is None else min(cap, left)
            out.append(dataclasses.replace(obs, token_ids=list(record.ids), max_new_tokens=cap))
        return out

    def record(self, rows: Sequence[int], observations: Sequence[Observation], generation: Generation) -> None:
        """Append each row's sampled ids (and their log-probs) to its sequence."""
        lengths = generation.completion_mask.sum(-1).tolist()
        for r, (row, obs) in enumerate(zip(rows, observations)):
            n = int(lengths[r])
            sampled = generation.completion_ids[r, :n].tolist()
            if not self.started[row]:
                self.started[row] = True
                prompt = generation.prompt_ids[r][generation.prompt_mask[r]].tolist()
                self.records[row] = SequenceRecord([], len(prompt))
                self.records[row].extend(prompt, sampled=False)  # type: ignore[union-attr]
            record = self.records[row]
            if record is not None:
                record.extend(sampled, sampled=True, logprobs=generation.logprobs[r, :n].tolist())
            end = sampled[-1] if sampled and sampled[-1] in self.end_ids else None
            self._last[row] = (obs, generation.texts[r], end)

    def advance(self, rows: Sequence[int], following: Sequence[Observation]) -> list[int]:
        """Append what the environment put between each row's last turn and ``following`` (its next observation);
        return the rows whose sequence has reached ``max_tokens`` (the driver ends them, truncated)."""
        over = []
        for row, obs in zip(rows, following):
            record = self.records[row]
            if record is None:
                continue
            previous, text, end = self._last[row]
            more = continuation_ids(self.policy, previous, text, end, obs)
            if more is None:
                self.records[row] = None
                self._say_fallback(obs)
                continue
            record.extend(more, sampled=False)
            if self.max_tokens is not None and len(record.ids) >= self.max_tokens:
                over.append(row)
        return over

    def _say_fallback(self, obs: Observation) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                "train.trajectory: an episode's next prompt does not extend its last prompt and completion (the "
                "chat template re-renders earlier turns, or the environment rewrote the history), so that episode "
                "trains as per-turn rows; every other such episode does the same, unannounced",
                stacklevel=2,
            )


def choose_trajectory(setting: str, env: Any, policy: Any, *, per_agent: bool = False) -> tuple[str, str]:
    """``("sequence" | "per_turn", the start-up line saying why)`` for ``train.trajectory`` (``setting``), the
    environment and the policy; the line is "" for a single-turn environment (both layouts are the same rows).

    One sequence needs one set of weights for every turn (``per_agent``: an ``agents:`` section gives agents
    parameters or credit of their own, as MAPPO does, and keeps per-turn rows) and a policy whose prompts extend each
    other (a prefix-preserving chat template); ``auto`` takes it where both hold, ``sequence`` asks for it (with
    ``per_agent`` that is an error), and a template that re-renders earlier turns falls back to per-turn rows either
    way."""
    multi_turn = getattr(env, "max_turns", 1) > 1
    if not multi_turn:
        return "per_turn", ""
    if setting == "per_turn":
        return "per_turn", "trajectory: per-turn rows (train.trajectory)"
    if per_agent:
        if setting == "sequence":
            from palestra.errors import ConfigError

            raise ConfigError(
                "train.trajectory: 'sequence' trains every turn of an episode with one set of weights and one reward; "
                "the agents: section gives agents their own (per-turn rows); use 'per_turn' or 'auto'"
            )
        return "per_turn", "trajectory: per-turn rows (the agents: section gives each agent its own rows)"
    preserving = getattr(policy, "prefix_preserving", None)
    if callable(preserving) and not preserving():
        return "per_turn", (
            "trajectory: per-turn rows: the policy's chat template re-renders earlier turns (it is not "
            "prefix-preserving), so an episode cannot be one token sequence"
        )
    return "sequence", "trajectory: one token sequence per episode (the loss on the model's own tokens)"
