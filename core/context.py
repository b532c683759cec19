"""What the trainer hands a component when it sets it up: one typed :class:`TrainContext`.

A component never has attributes set on it from outside, and nothing probes it for optional ones: whatever it
needs from the run (where tensors live, how many ranks there are, how gradients are averaged, which precision
the run computes in) arrives here, explicitly, in ``setup(policy, context)``. The trainer takes the precision of
its rollouts and evaluations from here too (:meth:`TrainContext.autocast`), so that sampling and the update agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from palestra.config import Config, TrainConfig
    from palestra.scale.distributed import DistributedContext

__all__ = ["TrainContext"]


def _no_sync(params: Sequence[Any]) -> None:
    """One process: gradients are already the global ones."""


@dataclass(frozen=True)
class TrainContext:
    """The run as a component sees it.

    * ``train``: the ``train`` section (learning rate, micro-batching, clipping, memory savers, ...);
    * ``device``: where the policy's parameters live (None outside a run: :meth:`autocast` is then a no-op);
    * ``distributed``: the :class:`~palestra.scale.distributed.DistributedContext` (rank, world size,
      collectives, FSDP); None in a single process without one;
    * ``precision``: ``fp32``, ``bf16`` or ``fp16`` (``train.precision``);
    * ``grad_sync``: averages gradients over ranks in place, called by the learner after the last micro-batch's
      backward; a no-op in one process.
    """

    train: TrainConfig
    device: torch.device | None = None
    distributed: DistributedContext | None = None
    precision: str = "fp32"
    grad_sync: Callable[[Sequence[torch.nn.Parameter]], None] = field(default=_no_sync)

    @classmethod
    def for_run(cls, config: Config, distributed: DistributedContext) -> TrainContext:
        """The context of a training run: every field from the config and the process group."""
        return cls(
            train=config.train,
            device=distributed.device,
            distributed=distributed,
            precision=config.train.precision,
            grad_sync=distributed.sync_gradients,
        )

    @classmethod
    def local(cls, train: TrainConfig) -> TrainContext:
        """A single-process context from a ``train`` section alone (tests, notebooks, ``palestra doctor``)."""
        return cls(train=train, precision=train.precision)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The autocast region of ``precision`` on ``device`` (a no-op for fp32): sampling and held-out evaluation
        run in the precision the learner trains in, so the rollout's log-probs match the update's as closely as they
        can."""
        import torch

        from palestra.scale.precision import PRECISIONS

        dtype = PRECISIONS[self.precision]
        if dtype is None or self.device is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    @property
    def is_distributed(self) -> bool:
        return self.distributed is not None and self.distributed.enabled

    @property
    def fsdp(self) -> bool:
        return self.distributed is not None and self.distributed.fsdp
