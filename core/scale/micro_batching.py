"""Memory savers for the update: token-budget micro-batches, a budget from free memory with out-of-memory
back-off, and CPU offload of the frozen reference and of the optimiser state.

Why they live here and not in the update loop: each is a small, separately testable policy about *where*
tensors go and *how many* rows a forward sees; the learner (:mod:`palestra.engine.micro_plans`) only asks for a
plan (:func:`plan_micro_batches`), trims each micro-batch (:func:`trim_padding`), and calls the offload helpers.

Token budget (``train.token_budget``): a micro-batch costs ``rows x (prompt width + completion width)``
tokens after its own padding is trimmed (prompt columns that are padding in every row on the left, completion
columns after every row's last scored token on the right — causal attention means those never change a
scored token). Rows are sorted by length before packing ("dynamic batching"), so that a micro-batch's rows
pad to similar widths; the micro-batches' order is shuffled. The update weights micro-batches exactly as
with ``train.grad_accum`` (token or row shares), so the pass's gradient is the full batch's.

Automatic size (``train.auto_micro_batch``): a budget from free memory (CUDA ``mem_get_info``; on a CPU
``MemAvailable`` from ``/proc/meminfo``) divided by an activation estimate per token
(:func:`activation_bytes_per_token`); on out-of-memory the pass is retried with half the budget, down to
one row per micro-batch.

Offload: the reference policy lives in CPU memory and visits the training device only to score
(:func:`borrowed`); the optimiser keeps an fp32 master copy of the weights and AdamW's moments in CPU memory,
gradients are copied there, the step runs on the CPU and the weights are copied back
(:class:`CPUMasterWeights`, ZeRO-Offload style). On a CPU-only machine both are identity in effect (the same
numbers; the code path still runs).
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import torch

from palestra.types import Experience

__all__ = [
    "OutOfMemory",
    "RowTooLong",
    "activation_bytes_per_token",
    "auto_token_budget",
    "free_cached_memory",
    "free_memory_bytes",
    "is_out_of_memory",
    "model_dims",
    "plan_micro_batches",
    "row_tokens",
    "trim_padding",
]

log = logging.getLogger("palestra.scale.micro_batching")

# Share of the free memory an automatic budget plans to use: the estimate is rough, and the allocator
# fragments; the out-of-memory back-off catches what this misses.
MEMORY_FRACTION = 0.5


class OutOfMemory(RuntimeError):
    """Out of memory even with one row per micro-batch: nothing left to back off to."""

    palestra_user_error = True


class RowTooLong(ValueError):
    """One row is bigger than the token budget by itself; ``row`` and ``tokens`` say which."""

    def __init__(self, row: int, tokens: int, budget: int) -> None:
        self.row, self.tokens, self.budget = row, tokens, budget
        super().__init__(f"row {row} needs {tokens} tokens, more than the budget of {budget}")


# ---- token-budget micro-batches ---------------------------------------------------------------------
def row_widths(batch: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the prompt's real width (left padding excluded) and the completion width up to the last scored
    token; both at least 1 (scoring needs the prompt's last state and one completion column). CPU int64 ``[B]``."""
    pm = batch.prompt_mask.to(torch.bool).cpu()
    cm = batch.completion_mask.to(torch.bool).cpu()
    p, t = pm.shape[1], cm.shape[1]
    cols_p = torch.arange(p)
    first = (
        torch.where(pm, cols_p, torch.full_like(cols_p, p)).amin(-1)
        if p
        else torch.zeros(pm.shape[0], dtype=torch.long)
    )
    prompt = (p - first).clamp(min=1)
    cols_t = torch.arange(t)
    last = torch.where(cm, cols_t, torch.full_like(cols_t, -1)).amax(-1) if t else torch.full((cm.shape[0],), -1)
    completion = (last + 1).clamp(min=1)
    return prompt, completion


def row_tokens(batch: Experience) -> torch.Tensor:
    """Each row's own token cost (prompt + completion width, no padding): what one row alone occupies."""
    p, t = row_widths(batch)
    return p + t


def plan_micro_batches(batch: Experience, budget: int, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Row indices of micro-batches of at most ``budget`` padded tokens each (see the module docstring).

    With a ``generator`` rows are drawn in a random order first (ties in length stay random) and the
    micro-batches come out shuffled; without one the plan is deterministic (scoring, where order is moot).
    Raises :class:`RowTooLong` for a row bigger than the budget alone.
    """
    p, t = row_widths(batch)
    n = batch.batch_size
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    total = (p + t)[order]
    order = order[torch.sort(total, descending=True, stable=True).indices]
    chunks: list[list[int]] = []
    current: list[int] = []
    wp = wt = 0
    for i in order.tolist():
        pi, ti = int(p[i]), int(t[i])
        if pi + ti > budget:
            raise RowTooLong(i, pi + ti, budget)
        np_, nt = max(wp, pi), max(wt, ti)
        if current and (len(current) + 1) * (np_ + nt) > budget:
            chunks.append(current)
            current, np_, nt = [], pi, ti
        current.append(i)
        wp, wt = np_, nt
    if current:
        chunks.append(current)
    out = [torch.tensor(c, dtype=torch.int64) for c in chunks]
    if generator is not None:
        out = [out[j] for j in torch.randperm(len(out), generator=generator).tolist()]
    return out


def trim_padding(batch: Experience) -> Experience:
    """``batch`` without the prompt columns that are padding in every row (left) and the completion columns
    after every row's last scored token (right). Per-token fields ``[B, T]`` are trimmed alike; the scores
    of the kept tokens do not change (positions count real tokens, attention is causal)."""
    p, t = row_widths(batch)
    keep_p, keep_t = int(p.max()), int(t.max())
    full_p, full_t = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    if keep_p >= full_p and keep_t >= full_t:
        return batch

    def tok(x: torch.Tensor | None) -> torch.Tensor | None:
        return x[:, :keep_t] if x is not None and x.dim() == 2 else x

    return Experience(
        prompt_ids=batch.prompt_ids[:, full_p - keep_p :],
        prompt_mask=batch.prompt_mask[:, full_p - keep_p :],
        completion_ids=batch.completion_ids[:, :keep_t],
        completion_mask=batch.completion_mask[:, :keep_t],
        behaviour_logprobs=tok(batch.behaviour_logprobs),  # type: ignore[arg-type]
        old_logprobs=tok(batch.old_logprobs),
        rewards=batch.rewards,
        advantages=tok(batch.advantages),  # type: ignore[arg-type]
        group_ids=batch.group_ids,
        agent_ids=batch.agent_ids,
        ref_logprobs=tok(batch.ref_logprobs),
        reward_components=batch.reward_components,
        metadata=batch.metadata,
        returns=tok(batch.returns),
        old_values=tok(batch.old_values),
        extras=batch.extras,
    )


# ---- a budget from free memory ------------------------------------------------------------------------
def free_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA ``mem_get_info``; otherwise the kernel's ``MemAvailable`` (psutil when
    installed and /proc/meminfo is not there; the free physical pages as a last resort)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # optional; not a dependency

        return int(psutil.virtual_memory().available)
    except ImportError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def model_dims(policy: Any) -> dict[str, int]:
    """``layers``, ``hidden``, ``heads``, ``vocab`` of a policy: its own
    :meth:`~palestra.models.policy.CausalLMPolicy.model_dims`
    when it states one (:class:`~palestra.models.policy.ShapeAware`: a causal-LM policy, or a multi-agent one over
    it), else guessed from the parameter count."""
    from palestra.models.policy import ShapeAware

    if isinstance(policy, ShapeAware):
        return policy.model_dims()
    params = sum(p.numel() for p in policy.parameters())
    hidden = max(8, int((params / 12) ** (1 / 3)))
    layers = max(1, round(params / (12 * hidden * hidden)))
    return {"layers": layers, "hidden": hidden, "heads": max(1, hidden // 64), "vocab": len(policy.tokenizer)}


def activation_bytes_per_token(
    dims: dict[str, int], seq_len: int, elem_bytes: int, *, checkpointing: bool = False
) -> float:
    """Bytes one token's training activations hold until the backward pass.

    Per transformer layer ``elem_bytes * (17 * hidden + 2.5 * heads * seq_len)`` (Korthikanti et al. 2022,
    ``sbh(34 + 5as/h)`` bytes at 2 bytes per element, eager attention); with checkpointing each layer keeps only
    its input and one layer is live at a time. The output head holds the logits and their gradient
    (``2 * vocab`` elements; the fused log-prob kernel adds only O(1) per token).
    """
    layer = elem_bytes * (17 * dims["hidden"] + 2.5 * dims["heads"] * seq_len)
    if checkpointing:
        layers = dims["layers"] * elem_bytes * dims["hidden"] + layer
    else:
        layers = dims["layers"] * layer
    return layers + 2 * elem_bytes * dims["vocab"] + 4 * dims["hidden"]


def auto_token_budget(
    policy: Any,
    device: torch.device,
    seq_len: int,
    elem_bytes: int,
    *,
    checkpointing: bool = False,
    free_bytes: int | None = None,
    fraction: float = MEMORY_FRACTION,
) -> int:
    """Tokens per micro-batch that fit ``fraction`` of the free memory (weights, gradients and optimiser state
    are already allocated, so free memory is what activations can use). At least 1."""
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    per_token = activation_bytes_per_token(model_dims(policy), seq_len, elem_bytes, checkpointing=checkpointing)
    return max(1, int(free * fraction / per_token))


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA's ``torch.OutOfMemoryError``, a RuntimeError saying "out of memory" (CPU allocators,
    older torch), and Python's ``MemoryError``."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def free_cached_memory(device: torch.device) -> None:
    """Drop what the failed attempt left behind: Python garbage, then CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
