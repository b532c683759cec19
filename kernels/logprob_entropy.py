"""Fused log-prob gather with entropy: :func:`logprob_entropy`.

For logits ``[..., V]`` and tokens ``[...]``, with ``z = logits / temperature``::

    logp    = z[token] - logsumexp(z)            (clamped to <= 0)
    entropy = -sum(softmax(z) * log_softmax(z))

Both outputs are float32 and shaped like ``tokens``; positions whose token is ``ignore_index`` give 0
and receive no gradient. The native back ends read each row once (a running max ``m`` with
``s = sum exp(z - m)`` and ``t = sum exp(z - m) * (z - m)``, so ``lse = m + log s`` and
``entropy = log s - t / s``), accumulate in float32 whatever the logits' dtype, and never allocate an
``[N, V]`` float32 intermediate. The backward pass recomputes ``p = softmax(z)`` from the saved ``lse``
and writes the logits' gradient once, in the logits' dtype::

    dz_j = g_logp * (1[j == token] - p_j) - g_entropy * p_j * (z_j - lse + entropy),   dlogits = dz / T

Back ends (see :mod:`palestra.kernels.dispatch`):

* ``torch``: the eager reference below, chunked over rows, differentiated by autograd;
* ``cpp``: csrc/cpu/logprob_entropy.cpp (``torch.ops.palestra.logprob_entropy``);
* ``cuda``: csrc/cuda/logprob_entropy.cu (the same op, CUDA dispatch key);
* ``triton``: kernels/triton_logprob_entropy.py (``torch.ops.palestra_triton.logprob_entropy``),
  imported only when that back end is used.

The native ops return a third output, ``lse`` (non-differentiable; 0 at ignored rows), which the
backward pass reuses. Ignored rows are not read at all. Token ids are range-checked in Python (one
reduction; a device sync on GPU) in eager mode, and again by the C++ kernel.

Precision: the statistics are float32, so the recomputed ``p`` in the backward pass carries a relative
error of about ``|lse| * 6e-8`` (negligible for LM logits; it grows for logits / T of order 1e5 and up).
Only first derivatives are provided (the backward op itself is not differentiable).
"""

from __future__ import annotations

import math

import torch

from .build import CPU_LIBRARY, CUDA_LIBRARY
from .dispatch import KernelOp
from .utils import check, check_tensor, shape_str

__all__ = ["LOGITS_DTYPES", "logprob_entropy", "logprob_entropy_reference"]

OP = "logprob_entropy"
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows of the eager reference are processed this many float32 elements at a time (64 MiB), so that a
# forward pass without autograd never holds more than one chunk of [rows, V] temporaries.
_REFERENCE_CHUNK_ELEMENTS = 1 << 24

_op = KernelOp(OP)


# ---- input checks ------------------------------------------------------------------------------------
def _check_inputs(logits, tokens, temperature, ignore_index) -> None:
    """One-line errors naming the argument; the token-range check runs in eager mode only."""
    check_tensor(OP, "logits", logits, dtypes=LOGITS_DTYPES, min_ndim=1)
    check_tensor(OP, "tokens", tokens)
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"{OP}: tokens has dtype {str(tokens.dtype).removeprefix('torch.')}, expected an integer dtype")
    check(
        tuple(tokens.shape) == tuple(logits.shape[:-1]),
        OP,
        f"tokens has shape {shape_str(tokens)}, expected logits.shape[:-1] = {list(logits.shape[:-1])} "
        f"(logits has shape {shape_str(logits)})",
    )
    check(logits.shape[-1] > 0, OP, f"logits has shape {shape_str(logits)}: the vocabulary (last) dimension is empty")
    check(
        tokens.device == logits.device,
        OP,
        f"tokens is on {tokens.device} but logits is on {logits.device}",
    )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{OP}: temperature must be a float, got {type(temperature).__name__}")
    check(
        math.isfinite(temperature) and temperature > 0,
        OP,
        f"temperature must be a finite number > 0, got {temperature}",
    )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{OP}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if not torch.compiler.is_compiling():  # data-dependent; the native kernels re-check it when compiled
        _check_token_range(tokens, logits.shape[-1], ignore_index)


def _check_token_range(tokens: torch.Tensor, vocab: int, ignore_index: int) -> None:
    # One reduction (one device sync on GPU); the offending value is looked up only on failure.
    bad = (tokens != ignore_index) & ((tokens < 0) | (tokens >= vocab))
    if tokens.numel() and bool(bad.any()):
        value = int(tokens[bad].reshape(-1)[0])
        raise ValueError(
            f"{OP}: tokens contains {value}, outside [0, V) with V = {vocab} (logits.shape[-1]) "
            f"and not ignore_index ({ignore_index})"
        )


# ---- torch reference -----------------------------------------------------------------------------
def logprob_entropy_reference(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager reference on 2-D inputs (logits [N, V], tokens [N] int64), float32 math, autograd native.

    Chunked over rows so that, without autograd, only one chunk's [rows, V] float32 temporaries are
    alive at a time (with autograd, each chunk's log-softmax is saved for the backward pass).
    """
    n_rows, vocab = logits.shape
    keep = tokens != ignore_index
    safe_tokens = torch.where(keep, tokens, torch.zeros_like(tokens))
    rows_per_chunk = max(1, _REFERENCE_CHUNK_ELEMENTS // vocab)
    # log-probabilities of -inf logits are clamped to the lowest float so that p * log p is 0 * finite.
    lowest = torch.finfo(torch.float32).min
    logps, entropies = [], []
    for start in range(0, n_rows, rows_per_chunk):
        z = logits[start : start + rows_per_chunk].float() / temperature
        log_q = torch.log_softmax(z, dim=-1)
        logps.append(log_q.gather(-1, safe_tokens[start : start + rows_per_chunk, None]).squeeze(-1))
        entropies.append(-(log_q.exp() * log_q.clamp(min=lowest)).sum(-1))
    zero = logits.new_zeros((), dtype=torch.float32)
    logp = torch.where(keep, torch.cat(logps).clamp(max=0.0), zero)
    entropy = torch.where(keep, torch.cat(entropies), zero)
    return logp, entropy


@_op.register("torch")
def _torch_impl(logits, tokens, temperature, ignore_index):
    return logprob_entropy_reference(logits, tokens, temperature, ignore_index)


# ---- native back ends (torch.ops.palestra.logprob_entropy, CPU and CUDA dispatch keys) -----------
def _native_impl(logits, tokens, temperature, ignore_index):
    logp, entropy, _lse = torch.ops.palestra.logprob_entropy(logits, tokens, temperature, ignore_index)
    return logp, entropy


_op.register("cpp", CPU_LIBRARY)(_native_impl)
_op.register("cuda", CUDA_LIBRARY)(_native_impl)


@_op.register("triton")
def _triton_impl(logits, tokens, temperature, ignore_index):
    from . import triton_logprob_entropy  # noqa: F401  (registers torch.ops.palestra_triton.*)

    logp, entropy, _lse = torch.ops.palestra_triton.logprob_entropy(logits, tokens, temperature, ignore_index)
    return logp, entropy


def fake_forward(logits, tokens, temperature, ignore_index):
    """Shapes of (logp, entropy, lse) for fake tensors: three float32 [N]."""
    n_rows = logits.shape[0]
    return tuple(logits.new_empty((n_rows,), dtype=torch.float32) for _ in range(3))


def fake_backward(grad_logp, grad_entropy, logits, tokens, lse, entropy, temperature, ignore_index):
    return torch.empty_like(logits)


def setup_context(ctx, inputs, output) -> None:
    """Save what the backward pass needs: the logits themselves and O(N) statistics."""
    logits, tokens, temperature, ignore_index = inputs
    _logp, entropy, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, tokens, lse, entropy)
    ctx.temperature, ctx.ignore_index = temperature, ignore_index


def make_backward(backward_op):
    """Autograd formula calling ``backward_op`` (the C++/CUDA or the Triton backward op)."""

    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        logits, tokens, lse, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse)
        grad = backward_op(grad_logp, grad_entropy, logits, tokens, lse, entropy, ctx.temperature, ctx.ignore_index)
        return grad, None, None, None

    return backward


def _register_native_formulas() -> None:
    # Runs once the C++ schema exists (CPU_LIBRARY holds ops.cpp; the CUDA library loads it first).
    torch.library.register_fake("palestra::logprob_entropy")(fake_forward)
    torch.library.register_fake("palestra::logprob_entropy_backward")(fake_backward)
    torch.library.register_autograd(
        "palestra::logprob_entropy",
        make_backward(torch.ops.palestra.logprob_entropy_backward),
        setup_context=setup_context,
    )


if CPU_LIBRARY.loaded:
    _register_native_formulas()
else:
    CPU_LIBRARY.on_load(_register_native_formulas)


# ----------------------------------------------------------------------------------
def logprob_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probability of ``tokens`` and entropy of ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V]`` float32, bfloat16 or float16 (any leading shape; copied only if the
            flattened ``[N, V]`` view is not contiguous).
        tokens: ``[...]`` integer ids in ``[0, V)``, or ``ignore_index``; shape ``logits.shape[:-1]``.
        temperature: divides the logits (> 0).
        ignore_index: token id marking positions that give ``logp = entropy = 0`` and no gradient.
        backend: force one back end (``torch``, ``cpp``, ``cuda``, ``triton``) for this call; by default
            the device (and ``PALESTRA_KERNELS`` / :func:`palestra.kernels.set_backend`) chooses.

    Returns:
        ``(logp, entropy)``, float32, shaped like ``tokens``; both differentiable w.r.t. ``logits``.
    """
    _check_inputs(logits, tokens, temperature, ignore_index)
    lead_shape = tokens.shape
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    if not flat_logits.is_contiguous():
        flat_logits = flat_logits.contiguous()
    flat_tokens = tokens.reshape(-1).to(torch.int64).contiguous()
    impl = _op(flat_logits.device, backend)
    logp, entropy = impl(flat_logits, flat_tokens, float(temperature), int(ignore_index))
    return logp.reshape(lead_shape), entropy.reshape(lead_shape)
