"""Generation for several agents at once: each agent's rows sampled apart (by its own parameters), merged back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from palestra.types import Generation, Generator, Observation, SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["generate_by_agent", "merge_generations"]


def merge_generations(parts: Sequence[Generation], rows: Sequence[Sequence[int]], pad_token_id: int) -> Generation:
    """One :class:`Generation` from several over disjoint rows: ``parts[k]`` answered rows ``rows[k]`` of the whole."""
    import torch

    n = sum(len(r) for r in rows)
    p = max(g.prompt_ids.shape[1] for g in parts)
    t = max(g.completion_ids.shape[1] for g in parts)
    first = parts[0]
    dev = first.prompt_ids.device
    out = Generation(
        texts=[""] * n,
        prompt_ids=torch.full((n, p), pad_token_id, dtype=torch.int64, device=dev),
        prompt_mask=torch.zeros((n, p), dtype=torch.bool, device=dev),
        completion_ids=torch.full((n, t), pad_token_id, dtype=torch.int64, device=dev),
        completion_mask=torch.zeros((n, t), dtype=torch.bool, device=dev),
        logprobs=torch.zeros((n, t), dtype=torch.float32, device=dev),
    )
    for g, idx in zip(parts, rows):
        i = torch.as_tensor(list(idx), dtype=torch.int64, device=dev)
        gp, gt = g.prompt_ids.shape[1], g.completion_ids.shape[1]
        out.prompt_ids[i, p - gp :] = g.prompt_ids  # prompts are left-padded
        out.prompt_mask[i, p - gp :] = g.prompt_mask
        out.completion_ids[i, :gt] = g.completion_ids  # completions right-padded
        out.completion_mask[i, :gt] = g.completion_mask
        out.logprobs[i, :gt] = g.logprobs
        for k, text in zip(idx, g.texts):
            out.texts[k] = text
    return out


def generate_by_agent(
    backend: Generator,
    policy: Any,
    observations: Sequence[Observation],
    params: SamplingParams,
    *,
    rng: torch.Generator | None = None,
) -> Generation:
    """Sample every row with ``policy``, one backend call per policy that plays the rows' agents; one Generation back.

    ``policy.for_agent(agent_id)`` says who plays a row. A single-agent policy plays every agent itself, so all its
    rows are one call (one batch, one draw per step); a :class:`~palestra.multiagent.sharing.MultiAgentPolicy` has a
    view per agent, so each agent's rows are a call of their own (its decode steps use that agent's view and KV
    cache), in order of first appearance. The backend gets ``policy`` itself, never a view: the rows' agent ids
    reach its decode steps, and under FSDP2 its forward hooks (the root's) run around each one.
    """
    groups: dict[int, list[int]] = {}  # id(the policy that plays the row) -> its rows
    for i, o in enumerate(observations):
        groups.setdefault(id(policy.for_agent(o.agent_id)), []).append(i)
    if len(groups) == 1:
        return backend.generate(policy, observations, params, generator=rng)
    rows = list(groups.values())
    parts = [backend.generate(policy, [observations[i] for i in idx], params, generator=rng) for idx in rows]
    return merge_generations(parts, rows, policy.tokenizer.pad_token_id)
