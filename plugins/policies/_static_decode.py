"""Decoding a HuggingFace policy near the hardware: a preallocated KV cache, prompts prefilled once per group, and
an attention written for one query token.

Three things cost the plain loop (:class:`palestra.models.sampling.PolicySteps` over transformers' ``DynamicCache``)
most of its time on a CPU, measured on SmolLM2-135M in bf16, 64 rows x 64 tokens (docs/performance.md):

* **the attention**: torch's CPU flash-attention kernel takes about 1.8 ms a layer for one query token against
  100 keys, a quarter of the loop. :func:`decode_attention` is two small batched matmuls: the query heads that share
  a key/value head are stacked into one matrix, so the cache is read once and never copied per head (transformers'
  eager attention copies it ``heads / kv_heads`` times a layer);
* **the prompts**: a GRPO batch holds each prompt ``group_size`` times. :class:`StaticSteps` prefills each distinct
  prompt once and copies its keys and values into every row that asked it;
* **the cache**: every step of a ``DynamicCache`` concatenates each layer's keys and values into new tensors.
  transformers' ``StaticCache`` allocates the whole generation once and writes one column a step.

``compile=True`` also runs each decode step through ``torch.compile``: fixed shapes, with the cache's length
rounded up to a multiple of :data:`LENGTH_BUCKET`, so it compiles once per batch size and length bucket, not once
per prompt length. It fuses the element-wise work between the matmuls (norms, rotary embeddings, the gated MLP),
but compiling SmolLM2 takes one to two minutes on two cores, so it is off by default. On a GPU the compiled step
is also captured as a CUDA graph (``mode="reduce-overhead"``), so a decode step is one graph launch instead of a
few hundred kernel launches from Python. A graph reads the cache at fixed addresses, so compiled runs take their
caches from a :class:`CachePool` that keeps them between batches of the same shape.

The loop around it (sampling, stop conditions) is :func:`palestra.models.sampling.sample`'s, unchanged.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

LENGTH_BUCKET = 64  # with compile, cache lengths are rounded up to a multiple of this
ATTENTION = "palestra_decode"  # the name this module's attention is registered under in transformers
_registered = False


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for ``query [B, H, Q, D]`` over ``key``/``value [B, Hkv, L, D]`` with an additive float mask
    ``[B, 1, Q, L]``; returns ``[B, Q, H, D]`` as transformers' attention functions do.

    Query head ``i`` reads key/value head ``i // (H / Hkv)`` (transformers' ``repeat_kv`` order), so the query heads
    of one key/value head are adjacent: viewed as ``[B, Hkv, G * Q, D]`` they meet the cache in one matmul.
    """
    del module, kwargs
    if dropout:
        raise ValueError(f"{ATTENTION}: attention dropout {dropout} in a decode step (the model is not in eval mode)")
    b, h, q, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    g = h // hkv
    scores = torch.matmul(query.reshape(b, hkv, g * q, d), key.transpose(2, 3)).view(b, hkv, g, q, length)
    scores = scores * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, :length]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(b, hkv, g * q, length), value)
    return out.view(b, h, q, d).transpose(1, 2).contiguous(), None


def _register() -> None:
    """Register :func:`decode_attention` with transformers, with its eager (additive float) mask."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(ATTENTION, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)
    _registered = True


def _distinct_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, inverse)``: the index of each distinct prompt's first row (in order of appearance), and for each row
    the position of its prompt in ``first``. Rows are the same prompt when their ids and mask are."""
    seen: dict[tuple[int, ...], int] = {}
    first: list[int] = []
    inverse: list[int] = []
    ids = prompt_ids.masked_fill(~prompt_mask, -1).tolist()  # padding is -1 whatever its id, so the mask is in it
    for row, key in enumerate(map(tuple, ids)):
        at = seen.get(key)
        if at is None:
            at = seen[key] = len(first)
            first.append(row)
        inverse.append(at)
    device = prompt_ids.device
    return torch.tensor(first, device=device), torch.tensor(inverse, device=device)


class StaticSteps:
    """A :class:`palestra.models.sampling.DecodeStepper` for an :class:`HFPolicy`: see the module docstring.

    One instance serves one call of :func:`palestra.models.sampling.sample` (``max_new_tokens`` new tokens at most).
    """

    def __init__(
        self,
        policy: Any,
        max_new_tokens: int,
        *,
        share_prompts: bool = True,
        compile: bool = False,
        caches: CachePool | None = None,
    ) -> None:
        _register()
        self.policy, self.n, self.share_prompts = policy, max_new_tokens, share_prompts
        self.cache: Any = None
        self.caches = caches
        self.mask = torch.empty(0)  # the attention mask over the whole cache, [B, cache length]
        self.prompt_rows = 0  # rows prefilled (distinct prompts when shared): for the tests and the bench
        self.compiled = compile
        device = next(policy.hf_model.parameters()).device
        self._run = _compiled(self._step, cuda_graphs=device.type == "cuda") if compile else self._step

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from transformers import StaticCache

        policy = self.policy
        b, p = prompt_ids.shape
        if self.share_prompts:
            first, inverse = _distinct_rows(prompt_ids, prompt_mask)
        else:
            first = inverse = torch.arange(b, device=prompt_ids.device)
        self.prompt_rows = int(first.numel())
        hidden, grown = policy.trunk(prompt_ids[first], prompt_mask[first], positions[first], None, use_cache=True)
        logits = policy.logits(hidden[:, -1]).float()
        length = p + self.n
        if self.compiled:  # one compiled graph per bucket of lengths, not one per prompt length
            length = -(-length // LENGTH_BUCKET) * LENGTH_BUCKET

        def allocate() -> Any:
            return StaticCache(config=policy.hf_model.config, max_cache_len=length)

        if self.caches is None:
            self.cache = allocate()
        else:
            self.cache = self.caches.get((b, length, grown.layers[0].keys.dtype, prompt_ids.device), allocate)
        self.mask = torch.zeros((b, length), dtype=torch.long, device=prompt_ids.device)
        self.mask[:, :p] = prompt_mask
        for layer, filled in zip(self.cache.layers, grown.layers, strict=True):
            # The first update allocates the layer's [B, Hkv, P + N, D] tensors and writes columns 0..P-1.
            layer.update(filled.keys.index_select(0, inverse), filled.values.index_select(0, inverse))
        return logits.index_select(0, inverse)

    def step(self, token: torch.Tensor, mask: torch.Tensor, length: int, position: torch.Tensor) -> torch.Tensor:
        # The loop wrote one new column; the cache knows how far it is filled, and the columns past it are masked
        # by causality whatever they hold.
        self.mask[:, length - 1] = mask[:, length - 1]
        return self._run(token, self.mask, position)

    def _step(self, token: torch.Tensor, mask: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.policy.trunk(token, mask, position, self.cache, use_cache=True, attention=ATTENTION)
        return self.policy.logits(hidden[:, -1]).float()


class CachePool:
    """The last few static KV caches, keyed by ``(rows, length, dtype, device)``, kept between calls and reset for
    reuse: a compiled decode step then meets the same tensors every batch of a shape, and a CUDA graph, which reads
    them at the addresses it was recorded with, is replayed rather than recorded again."""

    def __init__(self, size: int = 2) -> None:
        self.size = size  # a training batch and an evaluation batch, typically
        self._caches: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def get(self, key: tuple[Any, ...], allocate: Callable[[], Any]) -> Any:
        cache = self._caches.pop(key, None)
        if cache is None:
            cache = allocate()
        else:
            cache.reset()  # zeroed, and filled from column 0 again
        self._caches[key] = cache
        while len(self._caches) > self.size:
            self._caches.popitem(last=False)
        return cache


def _compiled(step: Any, *, cuda_graphs: bool) -> Any:
    """``step`` through ``torch.compile`` (as a CUDA graph when ``cuda_graphs``); where compiling fails (no C++
    compiler, an unsupported model), the eager ``step`` from then on, said once."""
    compiled = torch.compile(step, dynamic=False, mode="reduce-overhead" if cuda_graphs else None)
    state = {"fn": compiled}

    def run(*args: torch.Tensor) -> torch.Tensor:
        try:
            if cuda_graphs and state["fn"] is compiled:
                # Each call is a new step of the graph tree, and its output lives in the graph's memory, which the
                # next replay overwrites: the loop keeps the logits' tokens and log-probs, so it gets its own copy.
                torch.compiler.cudagraph_mark_step_begin()
                return state["fn"](*args).clone()
            return state["fn"](*args)
        except Exception as e:  # any compiler failure falls back to the eager step
            if state["fn"] is step:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            warnings.warn(f"static_kv: torch.compile failed ({first[:200]}); decoding eagerly", stacklevel=2)
            state["fn"] = step
            return step(*args)

    return run


__all__ = ["ATTENTION", "CachePool", "StaticSteps", "decode_attention"]
