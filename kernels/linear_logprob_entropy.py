"""Output head, log-prob gather and entropy in one op: :func:`linear_logprob_entropy`.

For hidden states ``h [N, H]``, an output head ``W [V, H]`` (and bias ``b [V]``) and targets ``[N]``::

    z       = (h @ W^T + b) / temperature
    logp    = z[target] - logsumexp(z)
    entropy = -sum(softmax(z) * log_softmax(z))

the same numbers as ``logprob_entropy(F.linear(h, W, b), targets, temperature)``, without the ``[N, V]``
logits living from the forward pass to the backward pass. The rows are cut into chunks of at most
``chunk_bytes`` of float32 logits (64 MiB by default). Per chunk the forward computes the logits in float32 and
runs the :mod:`~palestra.kernels.logprob_entropy` kernel of the chosen back end over them, keeping only its O(N)
statistics (``lse``, ``entropy``); the chunk's logits are then freed. The backward pass recomputes each chunk's
logits, turns them into ``dz`` with the same kernel's backward (``dz = g_logp * (onehot - p) - g_entropy * p *
(log p + entropy)``, divided by the temperature), and reduces ``dz`` at once into the three gradients::

    dh[chunk] = dz @ W        dW += dz^T @ h[chunk]        db += dz.sum(0)

So what autograd keeps is the inputs themselves (``h``, ``W``, ``b``, which the model keeps anyway) plus three
float32 ``[N]`` vectors, and the largest temporaries, at any time, are one chunk's logits and its ``dz`` (plus a
float32 copy of ``W`` and the float32 ``dW`` accumulator when the head is not float32). This is Liger-Kernel's
fused linear cross-entropy idea, except that the gradient cannot be computed in the forward pass: the upstream
gradients of ``logp`` and ``entropy`` are per token and only known in the backward pass. The price is one more
``h @ W^T`` (four matmuls instead of three).

Precision: whatever the dtypes of ``h`` and ``W`` (float32, bfloat16, float16; they may differ, as under
autocast), the logits, the statistics and the gradients are computed in float32, and each gradient is returned in
its input's dtype. The unfused path with a bf16 head rounds the logits to bf16 first; this op does not, so on a
bf16 model the two differ by that rounding. float64 inputs are computed in float64 on the torch back end (the
native kernels are float32), with float64 outputs: that is what ``torch.autograd.gradcheck`` needs.

Rows whose target is ``ignore_index`` give 0 and no gradient, but their matmul is still computed: callers with
much padding gather the valid rows first (as :meth:`palestra.models.policy.CausalLMPolicy.score` does).

Back ends: the per-chunk kernel is that of ``logprob_entropy`` on the same back end (``torch``: plain torch
math; ``cpp`` / ``cuda``: ``torch.ops.palestra.logprob_entropy``; ``triton``); the matmuls are torch's. The op is
``torch.ops.palestra_fused.linear_logprob_entropy`` (a :func:`torch.library.custom_op` with a fake kernel and an
autograd formula, so it works under ``torch.compile``); only first derivatives are provided.
"""

from __future__ import annotations

import math

import torch

from .build import CPU_LIBRARY, CUDA_LIBRARY, NativeLibrary
from .dispatch import KernelOp
from .utils import check, check_tensor, shape_str

__all__ = ["DEFAULT_CHUNK_BYTES", "chunk_rows_for", "linear_logprob_entropy"]

OP = "linear_logprob_entropy"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# One chunk of float32 logits; the backward pass holds two such buffers (the logits and their gradient).
DEFAULT_CHUNK_BYTES = 64 << 20

_op = KernelOp(OP)


def chunk_rows_for(vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk: as many float32 ``[rows, vocab]`` logits as fit in ``chunk_bytes`` (at least one row)."""
    return max(1, chunk_bytes // (4 * max(1, vocab)))


# ---- the per-chunk log-prob kernels, per back end ---------------------------------------------------
# forward(logits [c, V], targets [c], temperature, ignore_index) -> (logp, entropy, lse), [c]
# backward(g_logp, g_entropy, logits, targets, lse, entropy, temperature, ignore_index) -> dlogits [c, V]
# all in the logits' dtype: float32 (float64 on the torch back end).
def _torch_forward(logits, targets, temperature, ignore_index):
    z = logits / temperature
    keep = targets != ignore_index
    lse = torch.logsumexp(z, dim=-1)
    log_q = z - lse[:, None]
    # -inf logits (a -inf bias) have p = 0; the lowest float keeps p * log p at 0 rather than nan.
    log_q_finite = log_q.clamp(min=torch.finfo(logits.dtype).min)
    entropy = -(log_q.exp() * log_q_finite).sum(-1)
    logp = log_q.gather(-1, torch.where(keep, targets, 0)[:, None]).squeeze(-1).clamp(max=0.0)
    zero = logits.new_zeros(())
    return torch.where(keep, logp, zero), torch.where(keep, entropy, zero), torch.where(keep, lse, zero)


def _torch_backward(grad_logp, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index):
    keep = targets != ignore_index
    log_q = (logits / temperature - lse[:, None]).clamp(min=torch.finfo(logits.dtype).min)
    dz = log_q.exp() * -(grad_logp[:, None] + grad_entropy[:, None] * (log_q + entropy[:, None]))
    dz.scatter_add_(-1, torch.where(keep, targets, 0)[:, None], grad_logp[:, None])
    # masked_fill, not a multiply by 0: an ignored row's lse is 0, so its p may have overflowed to inf.
    return dz.div_(temperature).masked_fill_(~keep[:, None], 0.0)


def _native_forward(logits, targets, temperature, ignore_index):
    return torch.ops.palestra.logprob_entropy(logits, targets, temperature, ignore_index)


def _native_backward(grad_logp, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index):
    return torch.ops.palestra.logprob_entropy_backward(
        grad_logp, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index
    )


def _triton_forward(logits, targets, temperature, ignore_index):
    return torch.ops.palestra_triton.logprob_entropy(logits, targets, temperature, ignore_index)


def _triton_backward(grad_logp, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index):
    return torch.ops.palestra_triton.logprob_entropy_backward(
        grad_logp, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index
    )


def _chunk_kernels(backend: str):
    """(forward, backward) of the per-chunk kernel of ``backend``, its library loaded."""
    if backend == "torch":
        return _torch_forward, _torch_backward
    if backend in ("cpp", "cuda"):
        library: NativeLibrary = CPU_LIBRARY if backend == "cpp" else CUDA_LIBRARY
        library.load()  # a no-op once loaded (dispatch loads it before the first call)
        return _native_forward, _native_backward
    if backend == "triton":
        from . import triton_logprob_entropy  # noqa: F401  (registers torch.ops.palestra_triton.*)

        return _triton_forward, _triton_backward
    raise ValueError(f"{OP}: unknown back end {backend!r}")


def _chunks(n_rows: int, max_rows: int) -> list[slice]:
    """The rows in equal chunks of at most ``max_rows`` (not ``max_rows`` and a remainder of one row)."""
    if n_rows == 0:
        return []
    n_chunks = -(-n_rows // max_rows)
    step = -(-n_rows // n_chunks)
    return [slice(start, min(n_rows, start + step)) for start in range(0, n_rows, step)]


def _chunk_logits(hidden32, weight32, bias32, buffer: torch.Tensor) -> torch.Tensor:
    """``hidden32 @ weight32^T + bias32`` written into the first rows of ``buffer``: one buffer serves every chunk,
    so each chunk does not page in a fresh allocation of its own."""
    out = buffer[: hidden32.shape[0]]
    if bias32 is None:
        return torch.mm(hidden32, weight32.t(), out=out)
    return torch.addmm(bias32, hidden32, weight32.t(), out=out)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64 (the torch back end only; it is there for gradcheck)."""
    return torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)  # no copy when it has that dtype already


# ---- the op -------------------------------------------------------------------------------------------
@torch.library.custom_op("palestra_fused::linear_logprob_entropy", mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    chunk_rows: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse), float32 [N] (float64 for float64 inputs), for hidden [N, H], weight [V, H], bias [V]
    or None and int64 targets [N]."""
    forward, _ = _chunk_kernels(backend)
    n_rows = hidden.shape[0]
    dtype = _compute_dtype(hidden, weight)
    logp, entropy, lse = (hidden.new_empty((n_rows,), dtype=dtype) for _ in range(3))
    weight32, bias32 = _cast(weight, dtype), _cast(bias, dtype)
    chunks = _chunks(n_rows, chunk_rows)
    buffer = hidden.new_empty((chunks[0].stop if chunks else 0, weight.shape[0]), dtype=dtype)
    for rows in chunks:
        logits = _chunk_logits(hidden[rows].to(dtype), weight32, bias32, buffer)
        for dst, src in zip((logp, entropy, lse), forward(logits, targets[rows], temperature, ignore_index)):
            dst[rows] = src
    return logp, entropy, lse


@_forward_op.register_fake
def _forward_fake(hidden, weight, bias, targets, temperature, ignore_index, chunk_rows, backend):
    n_rows = hidden.shape[0]
    return tuple(hidden.new_empty((n_rows,), dtype=_compute_dtype(hidden, weight)) for _ in range(3))


@torch.library.custom_op("palestra_fused::linear_logprob_entropy_backward", mutates_args=())
def _backward_op(
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    temperature: float,
    ignore_index: int,
    chunk_rows: int,
    backend: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d weight, d bias), each in its input's dtype; an empty [0] tensor for a gradient not needed."""
    _, backward = _chunk_kernels(backend)
    n_rows = hidden.shape[0]
    dtype = _compute_dtype(hidden, weight)
    weight32, bias32 = weight.to(dtype), _cast(bias, dtype)
    grad_logp = grad_logp.to(dtype).contiguous()
    grad_entropy = grad_entropy.to(dtype).contiguous()
    d_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty((0,))
    # Not zero-filled: the first chunk overwrites them (beta = 0 ignores what was there, NaN included).
    d_weight32 = torch.empty(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
    d_bias32 = torch.empty(weight.shape[0], dtype=dtype, device=weight.device) if need_bias else None
    chunks = _chunks(n_rows, chunk_rows)
    buffer = hidden.new_empty((chunks[0].stop if chunks else 0, weight.shape[0]), dtype=dtype)
    for i, rows in enumerate(chunks):
        hidden32 = hidden[rows].to(dtype)
        logits = _chunk_logits(hidden32, weight32, bias32, buffer)
        # dz: a second [chunk, V] buffer, alive until the chunk's three reductions are done
        dz = backward(
            grad_logp[rows],
            grad_entropy[rows],
            logits,
            targets[rows],
            lse[rows],
            entropy[rows],
            temperature,
            ignore_index,
        )
        if need_hidden:
            if d_hidden.dtype == dtype:
                torch.mm(dz, weight32, out=d_hidden[rows])
            else:
                d_hidden[rows] = torch.mm(dz, weight32)
        if d_weight32 is not None:
            d_weight32.addmm_(dz.t(), hidden32, beta=0.0 if i == 0 else 1.0)
        if d_bias32 is not None:
            if i == 0:
                torch.sum(dz, 0, out=d_bias32)
            else:
                d_bias32 += dz.sum(0)
        del dz
    if not chunks:  # no rows: zero gradients
        for t in (d_weight32, d_bias32):
            if t is not None:
                t.zero_()
    d_weight = weight.new_empty((0,)) if d_weight32 is None else d_weight32.to(weight.dtype)
    d_bias = weight.new_empty((0,)) if d_bias32 is None or bias is None else d_bias32.to(bias.dtype)
    return d_hidden, d_weight, d_bias


@_backward_op.register_fake
def _backward_fake(
    grad_logp,
    grad_entropy,
    hidden,
    weight,
    bias,
    targets,
    lse,
    entropy,
    temperature,
    ignore_index,
    chunk_rows,
    backend,
    need_hidden,
    need_weight,
    need_bias,
):
    d_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty((0,))
    d_weight = torch.empty_like(weight) if need_weight else weight.new_empty((0,))
    d_bias = torch.empty_like(bias) if need_bias else weight.new_empty((0,))
    return d_hidden, d_weight, d_bias


def _setup_context(ctx, inputs, output) -> None:
    """Save the inputs (alive anyway: the model's activations and parameters) and O(N) statistics."""
    hidden, weight, bias, targets, temperature, ignore_index, chunk_rows, backend = inputs
    _logp, entropy, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
    ctx.options = (temperature, ignore_index, chunk_rows, backend)


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    nothing = (None,) * 5
    if not (need_hidden or need_weight or need_bias):
        return (None, None, None, *nothing)
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    if grad_entropy is None:
        grad_entropy = torch.zeros_like(lse)
    d_hidden, d_weight, d_bias = torch.ops.palestra_fused.linear_logprob_entropy_backward(
        grad_logp,
        grad_entropy,
        hidden,
        weight,
        bias,
        targets,
        lse,
        entropy,
        *ctx.options,
        need_hidden,
        need_weight,
        need_bias,
    )
    return (
        d_hidden if need_hidden else None,
        d_weight if need_weight else None,
        d_bias if need_bias else None,
        *nothing,
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _impl_for(backend: str):
    def impl(hidden, weight, bias, targets, temperature, ignore_index, chunk_rows):
        return torch.ops.palestra_fused.linear_logprob_entropy(
            hidden, weight, bias, targets, temperature, ignore_index, chunk_rows, backend
        )

    return impl


# Every back end has an implementation (dispatch's check_backend asks each op for the forced one); the native
# ones need their library, which dispatch builds on first use.
for _backend, _library in (("torch", None), ("cpp", CPU_LIBRARY), ("cuda", CUDA_LIBRARY), ("triton", None)):
    _op.register(_backend, _library)(_impl_for(_backend))


# ---- input checks -------------------------------------------------------------------------------------
def _check_inputs(hidden, weight, bias, targets, temperature, ignore_index, chunk_bytes) -> None:
    """One-line errors naming the argument; the target-range check runs in eager mode only."""
    check_tensor(OP, "hidden", hidden, dtypes=DTYPES, min_ndim=1)
    check_tensor(OP, "weight", weight, dtypes=DTYPES, ndim=2)
    check(weight.shape[0] > 0, OP, f"weight has shape {shape_str(weight)}: the vocabulary (first) dimension is empty")
    check(
        hidden.shape[-1] == weight.shape[1],
        OP,
        f"hidden has shape {shape_str(hidden)} but weight has shape {shape_str(weight)}: "
        "hidden.shape[-1] must equal weight.shape[1]",
    )
    if bias is not None:
        check_tensor(OP, "bias", bias, dtypes=DTYPES, ndim=1)
        check(
            bias.shape[0] == weight.shape[0],
            OP,
            f"bias has shape {shape_str(bias)}, expected [{weight.shape[0]}] (weight.shape[0])",
        )
    check_tensor(OP, "targets", targets)
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        dtype = str(targets.dtype).removeprefix("torch.")
        raise TypeError(f"{OP}: targets has dtype {dtype}, expected an integer dtype")
    check(
        tuple(targets.shape) == tuple(hidden.shape[:-1]),
        OP,
        f"targets has shape {shape_str(targets)}, expected hidden.shape[:-1] = {list(hidden.shape[:-1])} "
        f"(hidden has shape {shape_str(hidden)})",
    )
    for name, t in (("weight", weight), ("bias", bias), ("targets", targets)):
        if t is not None:
            check(t.device == hidden.device, OP, f"{name} is on {t.device} but hidden is on {hidden.device}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{OP}: temperature must be a float, got {type(temperature).__name__}")
    check(
        math.isfinite(temperature) and temperature > 0,
        OP,
        f"temperature must be a finite number > 0, got {temperature}",
    )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{OP}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"{OP}: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if not torch.compiler.is_compiling() and targets.numel():  # data-dependent: one reduction (a sync on GPU)
        vocab = weight.shape[0]
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            value = int(targets[bad].reshape(-1)[0])
            raise ValueError(
                f"{OP}: targets contains {value}, outside [0, V) with V = {vocab} (weight.shape[0]) "
                f"and not ignore_index ({ignore_index})"
            )


# ---- public -------------------------------------------------------------------------------------------
def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = True,
    *,
    ignore_index: int = -100,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``targets`` and entropy under ``softmax((hidden @ weight^T + bias) / temperature)``,
    never holding more than one chunk of the ``[N, V]`` logits (see the module docstring).

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16 hidden states (the output head's input); float64 runs
            on the torch back end, in float64.
        weight: ``[V, H]`` the output head's weight (a tied embedding is fine), any of the same dtypes.
        bias: ``[V]`` or None.
        targets: ``[...]`` integer ids in ``[0, V)`` or ``ignore_index``, shaped ``hidden.shape[:-1]``.
        temperature: divides the logits (> 0).
        entropy: return the entropy (False: ``None`` in its place).
        ignore_index: target id marking rows that give ``logp = entropy = 0`` and no gradient.
        chunk_bytes: the float32 logits of one chunk of rows, at most (one row at least).
        backend: force the per-chunk kernel's back end (``torch``, ``cpp``, ``cuda``, ``triton``); by default the
            device (and ``PALESTRA_KERNELS`` / :func:`palestra.kernels.set_backend`) chooses.

    Returns:
        ``(logp, entropy or None)``, float32 (float64 for float64 inputs), shaped like ``targets``; differentiable
        w.r.t. ``hidden``, ``weight`` and ``bias``.
    """
    _check_inputs(hidden, weight, bias, targets, temperature, ignore_index, chunk_bytes)
    lead_shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    flat_targets = targets.reshape(-1).to(torch.int64).contiguous()
    if _compute_dtype(hidden, weight) == torch.float64:
        check(backend in (None, "torch"), OP, f"float64 inputs run on the torch back end only, got backend={backend!r}")
        backend = "torch"
    impl = _op(flat_hidden.device, backend)
    rows = chunk_rows_for(weight.shape[0], chunk_bytes)
    logp, ent, _lse = impl(flat_hidden, weight, bias, flat_targets, float(temperature), int(ignore_index), rows)
    return logp.reshape(lead_shape), (ent.reshape(lead_shape) if entropy else None)
