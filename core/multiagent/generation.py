"""Generation for several agents at once: each agent's rows sampled by the policy that plays it, merged back."""

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
    backend: Generator, policy: Any, observations: Sequence[Observation], params: SamplingParams, *, rng: torch.Generator | None = None
) -> Generation:
    """Sample each row with the policy that plays its agent (``policy.for_agent(agent_id)``); one Generation back.

    Rows played by the same policy are sampled together, in one backend call, in order of first appearance: a
    single-agent policy plays every agent itself, so its rows are one call (one batch, one draw per step), while a
    :class:`~palestra.multiagent.sharing.MultiAgentPolicy` samples each agent's rows with that agent's view.
    """
    players: dict[int, tuple[Any, list[int]]] = {}  # id(player) -> (player, its rows)
    for i, o in enumerate(observations):
        player = policy.for_agent(o.agent_id)
        players.setdefault(id(player), (player, []))[1].append(i)
    if len(players) == 1:
        return backend.generate(next(iter(players.values()))[0], observations, params, generator=rng)
    parts = [
        backend.generate(player, [observations[i] for i in idx], params, generator=rng)
        for player, idx in players.values()
    ]
    return merge_generations(parts, [idx for _, idx in players.values()], policy.tokenizer.pad_token_id)
