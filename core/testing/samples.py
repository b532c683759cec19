"""The inputs the checks feed components: small batches, plausible completions, a tiny policy and a scored batch.

Everything here is seeded, so a check that fails fails the same way every time.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from palestra.types import Observation

if TYPE_CHECKING:
    import torch

    from palestra.types import Experience

__all__ = [
    "COMPLETIONS",
    "SEED",
    "TINY_POLICY",
    "completions",
    "cycle_completions",
    "experience",
    "observations",
    "train_config",
]

SEED = 1234
# What a policy emits early in training: the answer format, an empty string, a bare number, plain words, junk.
COMPLETIONS = ("<answer>4</answer>", "", "4", "hello world", "<answer></answer> \u00e9\u00e8 !?")
# A policy small enough that a real set-up, prepare and update take well under a second on one CPU thread.
TINY_POLICY: dict[str, Any] = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32, "max_len": 64, "seed": 0}
PROMPTS = ("1 + 2 =", "12 + 30 = ?", "7 * 3 =", "4 - 1 =")


def cycle_completions(n: int, completions: Sequence[str] = COMPLETIONS) -> list[str]:
    """``n`` completions, going round ``completions``."""
    return [completions[i % len(completions)] for i in range(n)]


def observations(n: int, prompts: Sequence[str] = PROMPTS) -> list[Observation]:
    """``n`` observations of prompts of different lengths (so that left padding shows)."""
    return [Observation(prompt=prompts[i % len(prompts)], metadata={"answer": "3"}) for i in range(n)]


def train_config(overrides: Mapping[str, Any] | None = None) -> Any:
    """A small, valid ``train`` section: 2 tasks x 2 completions, a high learning rate so one step shows, on CPU."""
    from palestra.config import TrainConfig

    base: dict[str, Any] = {
        "steps": 10, "batch_size": 2, "group_size": 2, "lr": 1e-2, "max_grad_norm": 1.0, "max_new_tokens": 6,
        "device": "cpu", "track_update_ratio": False,
    }  # fmt: skip
    base.update(overrides or {})
    return TrainConfig(**base)


def completions(policy: Any, rows: int, *, width: int = 5, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Random completions of ragged lengths (1 to ``width`` tokens, right-padded) from the policy's ordinary tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokenizer = policy.tokenizer
    special = {tokenizer.pad_token_id, tokenizer.eos_token_id, getattr(tokenizer, "bos_token_id", None)}
    ordinary = torch.tensor([t for t in range(len(tokenizer)) if t not in special], dtype=torch.int64)
    lengths = torch.tensor([1 + (i * 3) % width for i in range(rows)])  # 1, 4, 2, 5, 3, ...: ragged
    mask = torch.arange(width)[None, :] < lengths[:, None]
    picks = ordinary[torch.randint(len(ordinary), (rows, width), generator=gen)]
    device = next(policy.parameters()).device
    return picks.masked_fill(~mask, tokenizer.pad_token_id).to(device), mask.to(device)


def experience(policy: Any, *, rows: int, group_size: int, seed: int = SEED) -> Experience:
    """A scored, on-policy batch as the trainer hands ``prepare``: prompts the policy encoded, random completions of
    different lengths, behaviour log-probs the policy's own, rewards that differ inside every group."""
    import torch

    from palestra.types import Experience

    rng = random.Random(seed)
    obs = observations(rows)
    with torch.no_grad():
        prompt_ids, prompt_mask = policy.encode_observations(obs)
    completion_ids, completion_mask = completions(policy, rows, seed=seed)
    device = prompt_ids.device
    with torch.no_grad():
        behaviour = policy.score(prompt_ids, prompt_mask, completion_ids, completion_mask, entropy=False).logprobs
    rewards = torch.tensor(
        [rng.choice([0.0, 0.25, 0.5, 1.0]) + (i % group_size) for i in range(rows)], dtype=torch.float32
    )
    return Experience(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        behaviour_logprobs=behaviour.detach().float(),
        rewards=rewards.to(device),
        advantages=torch.zeros(rows, device=device),
        group_ids=torch.arange(rows, device=device) // group_size,
        agent_ids=["assistant"] * rows,
        metadata=[{"answer": "3", "turn": 0, "agent_id": "assistant", "state": o.prompt} for o in obs],
    )
