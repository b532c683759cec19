"""Built-in generator ``kv_cache``: batched sampling with the policy's own KV cache (:mod:`palestra.models.sampling`).

It works with every :class:`palestra.models.policy.CausalLMPolicy` (the tiny transformer, HuggingFace models):
temperature, top-p, EOS and stop tokens, stop strings (the sampling parameters' and each observation's),
``max_new_tokens`` (the sampling parameters', capped per row by each observation's). Other back ends (vLLM, ...)
plug in as generators of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from palestra import hookimpl

if TYPE_CHECKING:
    import torch

    from palestra.types import Generation, Observation, Policy, SamplingParams


class KVCacheGenerator:
    """A :class:`palestra.types.Generator` over :func:`palestra.models.sampling.generate`. It takes no options."""

    def generate(
        self,
        policy: Policy,
        observations: Sequence[Observation],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> Generation:
        from palestra.models.sampling import generate

        return generate(policy, observations, params, generator=generator)


@hookimpl
def register_generators(register: Any) -> None:
    register(
        "kv_cache",
        KVCacheGenerator,
        description=(
            "batched sampling with the policy's KV cache: temperature, top-p, EOS, "
            "stop tokens and strings, per-turn caps"
        ),
    )


__all__ = ["KVCacheGenerator"]
