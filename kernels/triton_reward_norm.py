"""Triton back end of :func:`palestra.kernels.normalize_rewards`; imported only when that back end is used.

Three kernels on one stream, like the CUDA back end (one op call from the caller's view):

1. ``_partials_kernel``, one program per chunk of ``ITERS * SUB`` rewards: checks the chunk (NaN/inf
   rewards, segment ids outside ``[0, S)``) and, when updating, computes per-segment (count, mean, M2)
   partials: exact two-pass moments per sub-block of ``SUB`` rewards, Chan-merged across the chunk's
   sub-blocks. Segments are handled ``SEG_TILE`` at a time with a one-hot ``[SUB, SEG_TILE]`` tile,
   so the work grows with ``N * S / SEG_TILE``: meant for the few-agent case (S up to a few hundred).
2. ``_merge_kernel``, one program per ``MERGE_TILE`` segments: Chan-merges the chunks' partials with a
   fixed tree (``tl.reduce`` with Chan's formula as the combine; deterministic), folds them into the
   running state in place, and writes each segment's (shift, scale) for the write pass.
3. ``_write_kernel``: ``clamp((r - shift[s]) * scale[s], -clip, clip)`` in float32 (float64 math for
   float64 rewards).

Errors: kernel 1's per-chunk error records are reduced on the device and read back once (one
synchronisation) before kernel 2 may touch the state, so a bad batch raises and leaves the state as it was.
The op is wrapped as ``torch.ops.palestra_triton.normalize_rewards`` (a custom op with a fake kernel), so it
works under torch.compile as an opaque call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reward_norm import bad_segment_message, nonfinite_message

__all__ = ["normalize_rewards_op"]

SUB = 256  # rewards per two-pass sub-block (the one-hot tile is SUB x SEG_TILE float64 values)
SEG_TILE = 16  # segments per one-hot tile in kernel 1
MAX_MERGE_TILE = 32  # segments per program in kernel 2 (fewer when S is smaller)
MAX_CHUNK_TILE = 64  # chunk partials merged per tree step in kernel 2 (fewer when there are fewer chunks)
WRITE_BLOCK = 1024  # rewards per program in kernel 3
MAX_PARTIALS = 1 << 22  # bound on chunks x segments of float64 partials (x3)


@triton.jit
def _chan(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    n = n_a + n_b
    safe = tl.where(n > 0, n, 1.0)
    delta = mean_b - mean_a
    mean = mean_a + delta * (n_b / safe)
    m2 = m2_a + m2_b + delta * delta * (n_a * n_b / safe)
    return n, mean, m2


@triton.jit
def _partials_kernel(
    x_ptr,
    seg_ptr,
    n,
    S,
    part_ptr,
    err_ptr,
    num_chunks,
    ITERS,
    HAS_SEG: tl.constexpr,
    UPDATE: tl.constexpr,
    SUB: tl.constexpr,
    SEG_TILE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    start = pid * ITERS * SUB
    lanes = tl.arange(0, SUB).to(tl.int64)
    # -- checks: how many NaN/inf, the first one, the first id outside [0, S) and its value --------------
    nf_count = tl.zeros((), dtype=tl.int64)
    nf_first = n + tl.zeros((), dtype=tl.int64)
    bad_first = n + tl.zeros((), dtype=tl.int64)
    bad_value = tl.zeros((), dtype=tl.int64)
    for it in range(ITERS):
        offs = start + it * SUB + lanes
        inb = offs < n
        x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float64)
        nonfinite = inb & ((x - x) != 0.0)  # x - x is NaN exactly when x is NaN or inf
        nf_count += tl.sum(nonfinite.to(tl.int64), axis=0)
        nf_first = tl.minimum(nf_first, tl.min(tl.where(nonfinite, offs, n), axis=0))
        if HAS_SEG:
            seg = tl.load(seg_ptr + offs, mask=inb, other=0)
            bad = inb & ((seg < 0) | (seg >= S))
            first = tl.min(tl.where(bad, offs, n), axis=0)
            value = tl.sum(tl.where(offs == first, seg, 0), axis=0)
            take = first < bad_first
            bad_value = tl.where(take, value, bad_value)
            bad_first = tl.minimum(bad_first, first)
    tl.store(err_ptr + pid * 4 + 0, nf_count)
    tl.store(err_ptr + pid * 4 + 1, nf_first)
    tl.store(err_ptr + pid * 4 + 2, bad_first)
    tl.store(err_ptr + pid * 4 + 3, bad_value)
    if UPDATE:
        plane = num_chunks * S  # partials are [3, num_chunks, S]
        if HAS_SEG:
            for t in range(tl.cdiv(S, SEG_TILE)):
                sids = t * SEG_TILE + tl.arange(0, SEG_TILE).to(tl.int64)
                c_n = tl.zeros((SEG_TILE,), dtype=tl.float64)
                c_mean = tl.zeros((SEG_TILE,), dtype=tl.float64)
                c_m2 = tl.zeros((SEG_TILE,), dtype=tl.float64)
                for it in range(ITERS):
                    offs = start + it * SUB + lanes
                    inb = offs < n
                    x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float64)
                    seg = tl.load(seg_ptr + offs, mask=inb, other=-1)
                    hit = (seg[:, None] == sids[None, :]) & inb[:, None]
                    b_n = tl.sum(hit.to(tl.float64), axis=0)
                    b_mean = tl.sum(tl.where(hit, x[:, None], 0.0), axis=0) / tl.maximum(b_n, 1.0)
                    d = tl.where(hit, x[:, None] - b_mean[None, :], 0.0)
                    b_m2 = tl.sum(d * d, axis=0)
                    c_n, c_mean, c_m2 = _chan(c_n, c_mean, c_m2, b_n, b_mean, b_m2)
                smask = sids < S
                idx = pid * S + sids
                tl.store(part_ptr + idx, c_n, mask=smask)
                tl.store(part_ptr + plane + idx, c_mean, mask=smask)
                tl.store(part_ptr + 2 * plane + idx, c_m2, mask=smask)
        else:
            c_n = tl.zeros((), dtype=tl.float64)
            c_mean = tl.zeros((), dtype=tl.float64)
            c_m2 = tl.zeros((), dtype=tl.float64)
            for it in range(ITERS):
                offs = start + it * SUB + lanes
                inb = offs < n
                x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float64)
                b_n = tl.sum(inb.to(tl.float64), axis=0)
                b_mean = tl.sum(x, axis=0) / tl.maximum(b_n, 1.0)
                d = tl.where(inb, x - b_mean, 0.0)
                b_m2 = tl.sum(d * d, axis=0)
                c_n, c_mean, c_m2 = _chan(c_n, c_mean, c_m2, b_n, b_mean, b_m2)
            tl.store(part_ptr + pid, c_n)
            tl.store(part_ptr + plane + pid, c_mean)
            tl.store(part_ptr + 2 * plane + pid, c_m2)


@triton.jit
def _merge_kernel(
    part_ptr,
    num_chunks,
    S,
    count_ptr,
    mean_ptr,
    m2_ptr,
    shift_ptr,
    scale_ptr,
    params_ptr,
    UPDATE: tl.constexpr,
    MERGE_TILE: tl.constexpr,
    CHUNK_TILE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    eps = tl.load(params_ptr)  # float64: a float argument would reach the kernel rounded to float32
    sids = pid * MERGE_TILE + tl.arange(0, MERGE_TILE).to(tl.int64)
    smask = sids < S
    n = tl.load(count_ptr + sids, mask=smask, other=0.0)
    mean = tl.load(mean_ptr + sids, mask=smask, other=0.0)
    m2 = tl.load(m2_ptr + sids, mask=smask, other=0.0)
    if UPDATE:
        plane = num_chunks * S
        b_n = tl.zeros((MERGE_TILE,), dtype=tl.float64)
        b_mean = tl.zeros((MERGE_TILE,), dtype=tl.float64)
        b_m2 = tl.zeros((MERGE_TILE,), dtype=tl.float64)
        rows = tl.arange(0, CHUNK_TILE).to(tl.int64)
        for c0 in range(0, num_chunks, CHUNK_TILE):
            # CHUNK_TILE chunks at a time, merged by a fixed tree (tl.reduce with Chan's formula as the
            # combine); absent chunks have count 0, the merge's identity. Deterministic.
            chunks = c0 + rows
            m = (chunks[:, None] < num_chunks) & smask[None, :]
            idx = chunks[:, None] * S + sids[None, :]
            p_n = tl.load(part_ptr + idx, mask=m, other=0.0)
            p_mean = tl.load(part_ptr + plane + idx, mask=m, other=0.0)
            p_m2 = tl.load(part_ptr + 2 * plane + idx, mask=m, other=0.0)
            t_n, t_mean, t_m2 = tl.reduce((p_n, p_mean, p_m2), 0, _chan)
            b_n, b_mean, b_m2 = _chan(b_n, b_mean, b_m2, t_n, t_mean, t_m2)
        n, mean, m2 = _chan(n, mean, m2, b_n, b_mean, b_m2)
        tl.store(count_ptr + sids, n, mask=smask)
        tl.store(mean_ptr + sids, mean, mask=smask)
        tl.store(m2_ptr + sids, m2, mask=smask)
    has = n > 0
    var = m2 / tl.where(has, n, 1.0)
    scale = tl.where(has, 1.0 / tl.sqrt(var + eps), 1.0)  # float64 sqrt is IEEE-rounded
    shift = tl.where(has, mean, 0.0)
    tl.store(shift_ptr + sids, shift, mask=smask)
    tl.store(scale_ptr + sids, scale, mask=smask)


@triton.jit
def _write_kernel(
    x_ptr,
    seg_ptr,
    shift_ptr,
    scale_ptr,
    out_ptr,
    n,
    params_ptr,
    HAS_SEG: tl.constexpr,
    F64_MATH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < n
    if HAS_SEG:
        seg = tl.load(seg_ptr + offs, mask=inb, other=0)
    else:
        seg = tl.zeros((BLOCK,), dtype=tl.int64)
    shift = tl.load(shift_ptr + seg, mask=inb, other=0.0)
    scale = tl.load(scale_ptr + seg, mask=inb, other=1.0)
    x = tl.load(x_ptr + offs, mask=inb, other=0.0)
    clip = tl.load(params_ptr + 1)  # float64, may be inf
    if F64_MATH:
        y = (x.to(tl.float64) - shift) * scale
    else:
        y = (x.to(tl.float32) - shift.to(tl.float32)) * scale.to(tl.float32)
        clip = clip.to(tl.float32)
    y = tl.minimum(tl.maximum(y, -clip, propagate_nan=tl.PropagateNan.ALL), clip, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + offs, y.to(tl.float32), mask=inb)


def _raise_errors(errors: torch.Tensor, rewards: torch.Tensor, num_segments: int) -> None:
    """Reduce kernel 1's per-chunk records on the device; one read-back; raise like the other back ends."""
    n = rewards.numel()
    first_bad = errors[:, 2].min()
    summary = torch.stack([errors[:, 0].sum(), errors[:, 1].min(), first_bad, errors[errors[:, 2].argmin(), 3]])
    nf_count, nf_first, bad_first, bad_value = summary.tolist()
    if bad_first < n:
        raise ValueError(bad_segment_message(bad_value, bad_first, num_segments))
    if nf_count:
        raise ValueError(nonfinite_message(nf_count, nf_first, n, rewards.dtype))


@torch.library.custom_op("palestra_triton::normalize_rewards", mutates_args=("count", "mean", "m2"))
def normalize_rewards_op(
    rewards: torch.Tensor,
    segment_ids: torch.Tensor | None,
    count: torch.Tensor,
    mean: torch.Tensor,
    m2: torch.Tensor,
    clip: float,
    eps: float,
    update: bool,
) -> torch.Tensor:
    n, S = rewards.numel(), count.numel()
    dev = rewards.device
    out = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    has_seg = segment_ids is not None
    sub_blocks = triton.cdiv(n, SUB)
    # Chunks of ITERS sub-blocks: enough programs to fill a GPU, few enough partials for large S.
    max_chunks = max(1, min(1024, MAX_PARTIALS // S))
    iters = triton.cdiv(sub_blocks, max_chunks)
    num_chunks = triton.cdiv(sub_blocks, iters)
    part = torch.empty(3 * num_chunks * S if update else 1, dtype=torch.float64, device=dev)
    errors = torch.empty(num_chunks, 4, dtype=torch.int64, device=dev)
    seg_arg = segment_ids if has_seg else rewards  # never read when HAS_SEG is false
    _partials_kernel[(num_chunks,)](
        rewards,
        seg_arg,
        n,
        S,
        part,
        errors,
        num_chunks,
        iters,
        HAS_SEG=has_seg,
        UPDATE=update,
        SUB=SUB,
        SEG_TILE=SEG_TILE,
    )
    _raise_errors(errors, rewards, S)
    shift = torch.empty(S, dtype=torch.float64, device=dev)
    scale = torch.empty(S, dtype=torch.float64, device=dev)
    params = torch.tensor([eps, clip], dtype=torch.float64).to(dev, non_blocking=True)
    # Tiles sized to the problem: the tree merge costs CHUNK_TILE x MERGE_TILE per step.
    merge_tile = max(2, min(MAX_MERGE_TILE, triton.next_power_of_2(S)))
    chunk_tile = max(2, min(MAX_CHUNK_TILE, triton.next_power_of_2(num_chunks)))
    _merge_kernel[(triton.cdiv(S, merge_tile),)](
        part,
        num_chunks,
        S,
        count,
        mean,
        m2,
        shift,
        scale,
        params,
        UPDATE=update,
        MERGE_TILE=merge_tile,
        CHUNK_TILE=chunk_tile,
    )
    _write_kernel[(triton.cdiv(n, WRITE_BLOCK),)](
        rewards,
        seg_arg,
        shift,
        scale,
        out,
        n,
        params,
        HAS_SEG=has_seg,
        F64_MATH=rewards.dtype == torch.float64,
        BLOCK=WRITE_BLOCK,
    )
    return out


@normalize_rewards_op.register_fake
def _(rewards, segment_ids, count, mean, m2, clip, eps, update):
    return rewards.new_empty(rewards.shape, dtype=torch.float32)
