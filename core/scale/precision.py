"""Mixed precision for the update: ``train.precision`` = ``fp32`` | ``bf16`` | ``fp16``, through :mod:`torch.amp`.

Why a module of its own: the update loop (:meth:`palestra.engine.learner.Learner.update`) should read the same
whatever the precision is, so everything precision-specific lives behind four calls here —
:meth:`Precision.autocast` (around the policy forward only), :meth:`Precision.backward`,
:meth:`Precision.unscale_` (before clipping) and :meth:`Precision.step`.

* ``fp32``: no autocast, no scaling.
* ``bf16``: the policy forward runs under ``torch.autocast(device_type, torch.bfloat16)``; bf16 has fp32's
  exponent range, so no loss scaling.
* ``fp16``: autocast in float16 plus dynamic loss scaling (:class:`torch.amp.GradScaler`, which exists for
  ``cpu`` as well as ``cuda``). Gradients are unscaled before clipping; a step whose scaled gradients overflow
  is skipped by the scaler and the scale backs off — that is loss scaling working, not a bad step.

The weights keep their own dtype (``train.dtype``); log-probs come out of :func:`palestra.kernels.logprob_entropy`
in fp32 whatever the logits are, and the losses are computed outside the autocast region, so they are fp32.
The scaler's state is part of :meth:`Learner.state_dict` (exact resume keeps the scale and growth tracker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from palestra.errors import ConfigError

__all__ = ["PRECISIONS", "Precision"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """The autocast region and (for fp16) the loss scaler of one training run on ``device_type``."""

    def __init__(self, mode: str, device_type: str, *, param_dtype: torch.dtype = torch.float32) -> None:
        if mode not in PRECISIONS:
            raise ConfigError(f"train.precision: unknown precision {mode!r}; choose one of {', '.join(PRECISIONS)}")
        self.mode = mode
        self.device_type = device_type
        self.dtype: torch.dtype | None = PRECISIONS[mode]
        if self.dtype is not None and not torch.amp.is_autocast_available(device_type):
            raise ConfigError(
                f"train.precision: {mode} needs torch.autocast on {device_type!r}, which this torch lacks"
            )
        if mode == "fp16" and param_dtype == torch.float16:
            # GradScaler cannot unscale fp16 gradients (it refuses); loss scaling needs fp32 master weights.
            raise ConfigError(
                "train.precision: fp16 loss scaling needs float32 (or bfloat16) weights; train.dtype is float16 — "
                "set train.dtype: float32 with train.precision: fp16"
            )
        self.scaler: torch.amp.GradScaler | None = torch.amp.GradScaler(device_type) if mode == "fp16" else None

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The region the policy's forward runs in (a no-op for fp32)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with the loss scaled first under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the loss scale (before clipping); fp16 only."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """One step of each optimiser (the scaler skips them all when the gradients overflowed; it updates its
        scale once per step, whatever the number of optimisers); True when the step was taken."""
        if self.scaler is None:
            for optimizer in optimizers:
                optimizer.step()
            return True
        before = self.scaler.get_scale()
        for optimizer in optimizers:
            self.scaler.step(optimizer)
        self.scaler.update()
        # The scale only falls when the step was skipped for inf/nan gradients.
        return not self.scaler.get_scale() < before

    def skip(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """A bad step (non-finite loss) under fp16: let the scaler see the inf gradients and back off, so that
        every rank's scaler stays in the same state; no parameter moves."""
        if self.scaler is not None:
            for optimizer in optimizers:
                self.scaler.step(optimizer)  # skipped: unscale_ recorded inf
            self.scaler.update()

    def metrics(self) -> dict[str, float]:
        return {"amp/loss_scale": float(self.scaler.get_scale())} if self.scaler is not None else {}

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state is None:
            return  # a checkpoint from an fp32/bf16 run: a fresh scaler starts at its initial scale
        if self.scaler is None:
            return  # an fp16 checkpoint resumed in fp32/bf16: nothing to scale
        self.scaler.load_state_dict(dict(state))
