"""Built-in generator ``static_kv``: the ``kv_cache`` generator's sampling over a preallocated KV cache, each distinct
prompt prefilled once, and a one-query-token attention (:mod:`palestra.plugins.policies._static_decode`).

It samples what ``kv_cache`` samples (the same loop, the same draws from the same seed): greedy outputs are the
same, and the behaviour log-probs match a recomputation by ``policy.score``; only the model's arithmetic is
arranged differently, so bf16 logits can differ in their last bits. It serves the ``hf`` policy; with any other
policy it says so once and samples with the policy's own ``decode_step``, as ``kv_cache`` does.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palestra import hookimpl, option

if TYPE_CHECKING:
    import torch

    from palestra.types import Generation, Observation, Policy, SamplingParams


@dataclass
class StaticKVOptions:
    """Options of the ``static_kv`` generator (``generator.options`` in a config)."""

    share_prompts: bool = option(True)  # prefill each distinct prompt once (a GRPO group shares one)
    compile: bool = option(False)  # torch.compile the decode step (a minute on a CPU; a CUDA graph on a GPU)


class StaticKVGenerator:
    """A :class:`palestra.types.Generator`: see the module docstring."""

    def __init__(self, share_prompts: bool = True, compile: bool = False) -> None:
        self.share_prompts, self.compile = share_prompts, compile
        self._warned: set[str] = set()
        self._caches: Any = None  # compiled: the KV caches the compiled step (or CUDA graph) was built on

    def generate(
        self,
        policy: Policy,
        observations: Sequence[Observation],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> Generation:
        from palestra.models.sampling import generate

        steps = getattr(policy, "static_steps", None)
        if steps is None:
            name = type(policy).__name__
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"generator static_kv: {name} has no static KV cache (static_steps); sampling with its own "
                    "decode_step, as kv_cache does",
                    stacklevel=2,
                )
            return generate(policy, observations, params, generator=generator)

        if self.compile and self._caches is None:
            from palestra.plugins.policies._static_decode import CachePool

            self._caches = CachePool()

        def stepper(n: int) -> Any:
            return steps(n, share_prompts=self.share_prompts, compile=self.compile, caches=self._caches)

        return generate(policy, observations, params, generator=generator, stepper=stepper)


@hookimpl
def register_generators(register: Any) -> None:
    register(
        "static_kv",
        StaticKVGenerator,
        options=StaticKVOptions,
        description=(
            "kv_cache's sampling over a preallocated KV cache: each distinct prompt prefilled once, "
            "a one-token attention (hf policies)"
        ),
    )


__all__ = ["StaticKVGenerator", "StaticKVOptions"]
