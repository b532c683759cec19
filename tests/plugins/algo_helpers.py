"""A tiny but real causal-LM policy and hand-made batches for the algorithm tests.

``ToyPolicy``: embedding -> causal prefix mean (each position sees the mean of the real tokens up to it)
-> tanh(linear) -> layer norm -> linear head over a small vocabulary. ``reference_logprobs`` recomputes
its token log-probs in float64 by a path that does not use ``palestra.kernels`` (the tests' hand
computations start from it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from palestra.config import TrainConfig
from palestra.context import TrainContext
from palestra.engine.learner import Learner
from palestra.models.policy import CausalLMPolicy
from palestra.types import Experience

VOCAB = 13  # not a power of two


class ToyTokenizer:
    pad_token_id = 0
    eos_token_id = 1
    bos_token_id = None

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str) -> list[int]:
        return [2 + ord(c) % (VOCAB - 2) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class ToyPolicy(CausalLMPolicy):
    def __init__(self, seed: int = 0, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokenizer = ToyTokenizer()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, VOCAB, bias=False)
        self._hidden = hidden

    @property
    def hidden_size(self) -> int:
        return self._hidden

    def output_head(self) -> torch.nn.Module:
        return self.head

    def trunk(self, input_ids, attention_mask, position_ids, cache=None, *, use_cache=False):
        m = attention_mask[:, -input_ids.shape[1] :].to(self.embed.weight.dtype)[..., None]
        x = self.embed(input_ids) * m
        total, count = cache if cache is not None else (0.0, 0.0)
        sums = x.cumsum(1) + total
        counts = m.cumsum(1) + count
        h = self.norm(torch.tanh(self.mix(sums / counts.clamp(min=1.0))))
        new_cache = (sums[:, -1:], counts[:, -1:]) if use_cache else None
        return h, new_cache


def reference_logprobs(policy: ToyPolicy, batch: Experience, temperature: float = 1.0) -> torch.Tensor:
    """Token log-probs [B, T] in float64 by plain torch (0 where masked); no palestra kernels."""
    return reference_scores(policy, batch, temperature)[0]


def make_batch(
    rewards: Sequence[float],
    group_ids: Sequence[int],
    *,
    lengths: Sequence[int] | None = None,
    prompt_len: int = 3,
    width: int = 5,
    seed: int = 1,
    agent_ids: Sequence[str] | None = None,
) -> Experience:
    """Random tokens; completion ``b`` has ``lengths[b]`` real tokens (right-padded), prompts left-padded."""
    g = torch.Generator().manual_seed(seed)
    b = len(rewards)
    lengths = list(lengths) if lengths is not None else [width] * b
    completion_ids = torch.randint(2, VOCAB, (b, width), generator=g)
    completion_mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    completion_ids = completion_ids.masked_fill(~completion_mask, 0)
    prompt_ids = torch.randint(2, VOCAB, (b, prompt_len), generator=g)
    prompt_mask = torch.ones(b, prompt_len, dtype=torch.bool)
    prompt_mask[::2, 0] = False  # every other prompt left-padded by one
    prompt_ids = prompt_ids.masked_fill(~prompt_mask, 0)
    return Experience(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        behaviour_logprobs=torch.zeros(b, width),
        rewards=torch.tensor(list(rewards), dtype=torch.float32),
        advantages=torch.zeros(b),
        group_ids=torch.tensor(list(group_ids), dtype=torch.int64),
        agent_ids=list(agent_ids) if agent_ids is not None else ["assistant"] * b,
    )


def with_behaviour(policy: ToyPolicy, batch: Experience, shifts: torch.Tensor | None = None) -> Experience:
    """Set behaviour log-probs to the policy's own (float64 path) plus ``shifts`` [B, T] (0 where masked)."""
    logp = reference_logprobs(policy, batch)
    if shifts is not None:
        logp = logp + shifts.double()
    batch.behaviour_logprobs = torch.where(batch.completion_mask, logp, torch.zeros_like(logp)).float()
    return batch


def train_config(**overrides: Any) -> TrainConfig:
    base = dict(steps=10, batch_size=2, group_size=3, lr=1e-2, max_grad_norm=None, max_new_tokens=5)
    base.update(overrides)
    return TrainConfig(**base)


def learner_for(algorithm: Any, policy: Any, train: TrainConfig | None = None, *, reference: Any = None) -> Learner:
    """A single-process learner for ``algorithm`` on ``policy`` (``train``: :func:`train_config`'s defaults)."""
    return Learner(
        algorithm, policy, TrainContext.local(train if train is not None else train_config()), reference=reference
    )


@dataclass
class Masked:
    """Float64 helpers for hand computations over [B, T] with a bool mask."""

    mask: torch.Tensor

    def token_mean(self, x: torch.Tensor) -> float:
        m = self.mask.double()
        return float((x * m).sum() / m.sum())

    def seq_mean_token_mean(self, x: torch.Tensor) -> float:
        m = self.mask.double()
        return float(((x * m).sum(-1) / m.sum(-1)).mean())

    def seq_mean_token_sum_norm(self, x: torch.Tensor, length: int) -> float:
        m = self.mask.double()
        return float(((x * m).sum(-1) / length).mean())


def reference_scores(
    policy: ToyPolicy, batch: Experience, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 (log-probs, entropy) [B, T], 0 where masked, by plain torch (see :func:`reference_logprobs`)."""
    with torch.no_grad():
        p = batch.prompt_ids.shape[1]
        t = batch.completion_ids.shape[1]
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden, _ = policy.trunk(ids, mask, pos)
        logq = torch.log_softmax(policy.head(hidden[:, p - 1 : p + t - 1]).double() / temperature, -1)
        logp = logq.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
        ent = -(logq.exp() * logq).sum(-1)
        zero = torch.zeros_like(logp)
        return torch.where(batch.completion_mask, logp, zero), torch.where(batch.completion_mask, ent, zero)


def reference_values(policy: ToyPolicy, batch: Experience) -> torch.Tensor:
    """The value head's outputs [B, T] in float64 (0 where masked), by plain torch."""
    with torch.no_grad():
        p = batch.prompt_ids.shape[1]
        t = batch.completion_ids.shape[1]
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden, _ = policy.trunk(ids, mask, pos)
        v = policy.value_head(hidden[:, p - 1 : p + t - 1]).squeeze(-1).double()
        return torch.where(batch.completion_mask, v, torch.zeros_like(v))
