"""Triton back end of :func:`palestra.kernels.logprob_entropy` (imported only when it is used).

Registers ``torch.ops.palestra_triton.logprob_entropy`` and ``...logprob_entropy_backward`` as
:func:`torch.library.custom_op` s with fake (shape) kernels and the autograd formula shared with the
C++/CUDA op. They are opaque custom ops rather than ``triton_op`` s on purpose: under
``TRITON_INTERPRET=1`` (how CI runs them) ``wrap_triton`` hands back the interpreted kernel, which
torch.compile cannot capture, so a ``triton_op`` traced there would lose its kernels; an opaque op
behaves the same on a GPU and in the interpreter, so what CI tests is what runs.

Both kernels run one program per row and stream the row in ``BLOCK``-column chunks. The forward keeps a
running max ``m`` and, against it, ``s = sum 2^y`` and ``t = sum 2^y * y`` with
``y = (z - m) * log2(e)`` (base 2 so that the GPU's ``ex2`` does the work); when a chunk raises the
max, both are rescaled: ``s' = a * s``, ``t' = a * (t + d * s)`` with ``d = (m - m') * log2(e)``,
``a = 2^d``. Arguments of ``exp2`` are clamped at about -126 so that masked (-inf) logits add ~1e-38 rather
than ``0 * inf = NaN``; the running max starts at the lowest finite float (not -inf) for the same
reason. The constants in the kernels are log2(e) = 1.4426950408889634 and ln(2) = 0.6931471805599453.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .logprob_entropy import fake_backward, fake_forward, make_backward, setup_context
from .utils import triton_launch_settings

__all__ = ["logprob_entropy_backward_triton", "logprob_entropy_triton"]


@triton.jit
def _logprob_entropy_fwd_kernel(
    logits_ptr,
    tokens_ptr,
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    row_stride,
    vocab,
    inv_t,
    ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tok = tl.load(tokens_ptr + row)
    if tok == ignore_index:  # ignored rows are not read at all
        tl.store(logp_ptr + row, 0.0)
        tl.store(entropy_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
    else:
        row_ptr = logits_ptr + row * row_stride
        c2 = inv_t * 1.4426950408889634
        gap_lo = -126.0 / c2  # (z - m) * log2(e) >= -126: 2^y stays a normal float
        m = tl.full([], -3.4028234663852886e38, tl.float32)
        s = tl.zeros([], tl.float32)
        t = tl.zeros([], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # Gaps are clamped before scaling so that huge ones never overflow to -inf.
            d = tl.maximum(m - m_new, gap_lo) * c2
            alpha = tl.exp2(d)
            t = alpha * (t + d * s)
            s = alpha * s
            y = tl.maximum(x - m_new, gap_lo) * c2
            e = tl.where(mask, tl.exp2(y), 0.0)
            s += tl.sum(e, axis=0)
            t += tl.sum(e * y, axis=0)
            m = m_new
        log_s = tl.log(s)
        lse = m * inv_t + log_s
        # A token outside [0, V) (only possible when the Python check was skipped, under torch.compile)
        # is never dereferenced: its logp is NaN, as in the CUDA kernel.
        tok_ok = (tok >= 0) & (tok < vocab)
        x_tok = tl.load(row_ptr + tl.where(tok_ok, tok, 0), mask=tok_ok, other=float("nan")).to(tl.float32)
        # z_tok - lse as (x_tok - m) / T - ln s: no cancellation between two large numbers.
        tl.store(logp_ptr + row, tl.minimum((x_tok - m) * inv_t - log_s, 0.0))
        tl.store(entropy_ptr + row, tl.maximum(log_s - 0.6931471805599453 * t / s, 0.0))
        tl.store(lse_ptr + row, lse)


@triton.jit
def _logprob_entropy_bwd_kernel(
    grad_logp_ptr,
    grad_entropy_ptr,
    logits_ptr,
    tokens_ptr,
    lse_ptr,
    entropy_ptr,
    grad_ptr,
    row_stride,
    vocab,
    inv_t,
    ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tok = tl.load(tokens_ptr + row)
    row_ptr = logits_ptr + row * row_stride
    out_ptr = grad_ptr + row * row_stride
    if tok == ignore_index:
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            zero = tl.zeros([BLOCK], tl.float32)
            tl.store(out_ptr + cols, zero.to(out_ptr.dtype.element_ty), mask=cols < vocab)
    else:
        g_logp = tl.load(grad_logp_ptr + row).to(tl.float32)
        g_ent = tl.load(grad_entropy_ptr + row).to(tl.float32)
        lse = tl.load(lse_ptr + row)
        ent = tl.load(entropy_ptr + row)
        # dlogits_j = p_j * (a + c * y_j) + inv_t * g_logp * 1[j == tok],  y_j = (z_j - lse) * log2(e)
        a = -inv_t * (g_logp + g_ent * ent)
        c = -inv_t * g_ent * 0.6931471805599453
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            # z - lse <= 0 up to rounding; clamped (before scaling) to keep 2^y finite and normal.
            y = tl.minimum(tl.maximum(x * inv_t - lse, -87.0), 88.0) * 1.4426950408889634
            g = tl.exp2(y) * (a + c * y) + tl.where(cols == tok, inv_t * g_logp, 0.0)
            tl.store(out_ptr + cols, g.to(out_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("palestra_triton::logprob_entropy", mutates_args=())
def logprob_entropy_triton(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse), float32 [N], for logits [N, V] and int64 tokens [N]."""
    logits, tokens = logits.contiguous(), tokens.contiguous()
    n_rows, vocab = logits.shape
    logp = logits.new_empty((n_rows,), dtype=torch.float32)
    entropy = logits.new_empty((n_rows,), dtype=torch.float32)
    lse = logits.new_empty((n_rows,), dtype=torch.float32)
    if n_rows > 0:
        block, num_warps = triton_launch_settings(vocab, logits.element_size())
        _logprob_entropy_fwd_kernel[(n_rows,)](
            logits,
            tokens,
            logp,
            entropy,
            lse,
            logits.stride(0),
            vocab,
            1.0 / temperature,
            ignore_index,
            BLOCK=block,
            num_warps=num_warps,
        )
    return logp, entropy, lse


@torch.library.custom_op("palestra_triton::logprob_entropy_backward", mutates_args=())
def logprob_entropy_backward_triton(
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    temperature: float,
    ignore_index: int,
) -> torch.Tensor:
    """Gradient of the logits (their dtype, [N, V]) from upstream grads and the saved lse / entropy."""
    logits, tokens = logits.contiguous(), tokens.contiguous()
    n_rows, vocab = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if n_rows > 0:
        grad_logp = grad_logp.to(torch.float32).contiguous()
        grad_entropy = grad_entropy.to(torch.float32).contiguous()
        lse, entropy = lse.contiguous(), entropy.contiguous()
        block, num_warps = triton_launch_settings(vocab, logits.element_size())
        _logprob_entropy_bwd_kernel[(n_rows,)](
            grad_logp,
            grad_entropy,
            logits,
            tokens,
            lse,
            entropy,
            grad,
            logits.stride(0),
            vocab,
            1.0 / temperature,
            ignore_index,
            BLOCK=block,
            num_warps=num_warps,
        )
    return grad


logprob_entropy_triton.register_fake(fake_forward)
logprob_entropy_backward_triton.register_fake(fake_backward)
torch.library.register_autograd(
    "palestra_triton::logprob_entropy",
    make_backward(torch.ops.palestra_triton.logprob_entropy_backward),
    setup_context=setup_context,
)
