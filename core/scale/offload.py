"""CPU offload: the frozen reference visits the training device only to score (:func:`borrowed`); the optimiser
keeps an fp32 master copy of the weights and AdamW's moments in CPU memory (:class:`CPUMasterWeights`,
ZeRO-Offload style). On a CPU-only machine both are identity in effect (the same numbers; the code path still runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["CPUMasterWeights", "borrowed"]

from palestra.scale.micro_batching import free_cached_memory


# ---- offload ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def borrowed(module: torch.nn.Module, device: torch.device) -> Iterator[torch.nn.Module]:
    """``module`` (kept in CPU memory) on ``device`` for the duration of the block, then back on the CPU.

    The offloaded reference policy visits the training device only to score a batch (OpenRLHF's
    ``ref_reward_offload``): its memory is free during rollout and the update. On a CPU device nothing moves.
    """
    if device.type == "cpu":
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to("cpu")
        free_cached_memory(device)


class CPUMasterWeights:
    """An fp32 copy of the trainable parameters in CPU memory, for an optimiser that steps on the CPU.

    ``grads_from(params)`` copies the device gradients into the master copies' ``.grad`` (fp32) and frees the
    device ones; after the optimiser steps on :attr:`master`, ``copy_to(params)`` writes the new weights back
    (cast to the parameters' dtype). Not for FSDP-sharded (DTensor) parameters: FSDP2 has its own
    ``CPUOffloadPolicy``.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        pin = torch.cuda.is_available() and any(p.device.type == "cuda" for p in params)
        self.master: list[torch.Tensor] = []
        for p in params:
            m = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
            m.copy_(p.detach())
            self.master.append(m)
        self._pin = pin

    @torch.no_grad()
    def grads_from(self, params: Sequence[torch.Tensor]) -> None:
        for m, p in zip(self.master, params):
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.empty(m.shape, dtype=torch.float32, device="cpu", pin_memory=self._pin)
            m.grad.copy_(p.grad.detach(), non_blocking=self._pin)
            p.grad = None  # the device copy is not needed any more
        if self._pin:
            torch.cuda.synchronize()

    @torch.no_grad()
    def copy_to(self, params: Sequence[torch.Tensor]) -> None:
        for m, p in zip(self.master, params):
            p.copy_(m, non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()

    @torch.no_grad()
    def load_from(self, params: Sequence[torch.Tensor]) -> None:
        """Refresh the master copy from the parameters (after a policy state_dict was loaded)."""
        for m, p in zip(self.master, params):
            m.copy_(p.detach())

    def zero_grad(self) -> None:
        for m in self.master:
            m.grad = None
