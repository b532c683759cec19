"""Fused running reward normalisation: :class:`RunningMoments` and :func:`normalize_rewards`.

``normalize_rewards(rewards, state)`` does, in one call (one native op; see the back ends below):

1. the batch's per-segment moments (count, mean, M2) in float64, numerically sound: exact two-pass
   moments per cache-sized block, folded together with Chan et al.'s parallel merge (never naive
   sum / sum-of-squares, which loses the variance when the mean is large against the spread);
2. the merge of those moments into the running state (Chan's formula, float64, in place), when
   ``update=True``;
3. the write: ``clamp((r - mean_s) / sqrt(var_s + eps), -clip, clip)`` with the *updated* statistics
   of each element's segment, computed in float32 (float64 for float64 rewards), returned as float32.

Segments give each agent its own statistics (multi-agent RL): ``segment_ids`` maps every reward to a
segment in ``[0, S)``. A segment that has no samples yet (``count == 0``, e.g. ``update=False`` on a
fresh state) passes its rewards through unnormalised, but clipped.

Back ends (chosen by device; see :mod:`palestra.kernels.dispatch`):

* ``torch``: the eager reference (bincount / index_add per-segment moments, merge, normalise);
* ``cpp``: csrc/cpu/reward_norm.cpp, chunks in parallel with at::parallel_for, partials merged in a fixed
  order, so the statistics are bitwise identical whatever the thread count;
* ``cuda``: csrc/cuda/reward_norm.cu, three kernels on one stream (block partials, a per-segment merge,
  the write); one op call from the caller's view;
* ``triton``: kernels/triton_reward_norm.py, the same three-kernel structure.

Errors are loud and one line: NaN/inf rewards (how many, and the first flat index), segment ids outside
``[0, S)`` (the value and S), mismatched shapes, dtypes or devices. On an error the state is untouched.
The op is not differentiable: its output carries no gradient (rewards are data, not parameters).
"""

from __future__ import annotations

import math

import torch

from .build import CPU_LIBRARY, CUDA_LIBRARY
from .dispatch import KernelOp
from .utils import check_tensor, dtype_name, shape_str

__all__ = ["REWARD_DTYPES", "RunningMoments", "normalize_rewards"]

OP = "normalize_rewards"
REWARD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

_op = KernelOp(OP)


# ---- one-line messages, worded alike by every back end (the C++ kernel words them the same way) -------
def bad_segment_message(value: int, index: int, num_segments: int) -> str:
    return (
        f"{OP}: segment_ids has value {value} at flat index {index}; ids must lie in [0, S) with "
        f"S={num_segments} (the state's num_segments)"
    )


def nonfinite_message(count: int, first: int, numel: int, dtype: torch.dtype) -> str:
    return (
        f"{OP}: rewards ({dtype_name(dtype)}, {numel} elements) has {count} non-finite value(s) (NaN/inf), "
        f"the first at flat index {first}"
    )


# ---- float64 moment algebra ------------------------------------------------------------------------
def chan_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Chan et al.'s parallel merge of two sets of (count, mean, M2); exact up to float64 rounding.

    Works elementwise on tensors (one entry per segment). An empty side leaves the other unchanged.
    """
    n = n_a + n_b
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    delta = mean_b - mean_a
    mean = mean_a + delta * (n_b / safe_n)
    m2 = m2_a + m2_b + delta * delta * (n_a * n_b / safe_n)
    return n, mean, m2


def chan_unmerge(n, mean, m2, n_a, mean_a, m2_a):
    """The moments ``b`` such that ``chan_merge(a, b) == (n, mean, m2)``: what was added since ``a``.

    Inverting the merge amplifies rounding by ``n / n_b``, but merging ``b`` back into a state that holds
    ``a`` scales it down by the same factor, so the round trip stays at float64 precision.
    """
    n_b = n - n_a
    has = n_b > 0
    safe_nb = torch.where(has, n_b, torch.ones_like(n_b))
    mean_b = mean_a + (mean - mean_a) * (n / safe_nb)
    d = mean_b - mean_a
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    m2_b = (m2 - m2_a - d * d * (n_a * n_b / safe_n)).clamp(min=0.0)
    zero = torch.zeros_like(n)
    return torch.where(has, n_b, zero), torch.where(has, mean_b, zero), torch.where(has, m2_b, zero)


def segment_moments(x: torch.Tensor, seg: torch.Tensor, num_segments: int):
    """Per-segment (count, mean, M2) of float64 ``x``: two-pass (mean first, then squared deviations)."""
    n = torch.bincount(seg, minlength=num_segments).to(torch.float64)
    total = torch.zeros(num_segments, dtype=torch.float64, device=x.device).index_add_(0, seg, x)
    mean = total / n.clamp(min=1.0)
    d = x - mean[seg]
    m2 = torch.zeros(num_segments, dtype=torch.float64, device=x.device).index_add_(0, seg, d * d)
    return n, mean, m2


def write_coefficients(count, mean, m2, eps: float, dtype: torch.dtype):
    """Per-segment (shift, scale) of the write pass; an empty segment passes through: (0, 1)."""
    has = count > 0
    var = m2 / torch.where(has, count, torch.ones_like(count))
    scale = torch.where(has, 1.0 / torch.sqrt(var + eps), torch.ones_like(var))
    shift = torch.where(has, mean, torch.zeros_like(mean))
    return shift.to(dtype), scale.to(dtype)


def write_dtype(rewards_dtype: torch.dtype) -> torch.dtype:
    """The write pass computes in float32, or in float64 for float64 rewards."""
    return torch.float64 if rewards_dtype == torch.float64 else torch.float32


# ---- running statistics ------------------------------------------------------------------------------
class RunningMoments:
    """Running count, mean and M2 (float64 tensors of shape ``[S]``, one entry per segment).

    ``var`` is the population variance ``M2 / count`` (NaN for a segment with no samples yet). Update it
    with :func:`normalize_rewards` (normalise and update in one call) or :meth:`update` (update only);
    combine states with :meth:`merge` (exact) or, across ``torch.distributed`` ranks, :meth:`all_reduce`.

    >>> state = RunningMoments(num_segments=2)
    >>> out = normalize_rewards(rewards, state, segment_ids=agent_ids)  # doctest: +SKIP
    """

    def __init__(self, num_segments: int = 1, device: torch.device | str = "cpu"):
        if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
            raise ValueError(f"RunningMoments: num_segments must be an int >= 1, got {num_segments!r}")
        zeros = lambda: torch.zeros(num_segments, dtype=torch.float64, device=device)  # noqa: E731
        self.count = zeros()
        self._mean = zeros()
        self.m2 = zeros()
        # The part of these statistics that every rank already holds, as of the last all_reduce: the next
        # all_reduce contributes only what was added since, so that repeated syncs never count data twice.
        self._synced = torch.zeros(3, num_segments, dtype=torch.float64, device=device)

    # -- views ---------------------------------------------------------------------------------------
    @property
    def num_segments(self) -> int:
        return self.count.numel()

    @property
    def device(self) -> torch.device:
        return self.count.device

    @property
    def mean(self) -> torch.Tensor:
        return self._mean

    @property
    def var(self) -> torch.Tensor:
        """Population variance ``M2 / count`` per segment (NaN where ``count == 0``)."""
        return self.m2 / self.count

    @property
    def std(self) -> torch.Tensor:
        return self.var.sqrt()

    # -- updates -------------------------------------------------------------------------------------
    def update(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None) -> RunningMoments:
        """Fold a batch into the statistics without keeping a normalised copy."""
        normalize_rewards(x, self, segment_ids=segment_ids, clip=None, update=True)
        return self

    def merge(self, other: RunningMoments) -> RunningMoments:
        """Fold ``other``'s statistics into these (Chan et al.; exact up to float64 rounding)."""
        if not isinstance(other, RunningMoments):
            raise TypeError(f"RunningMoments.merge: other must be a RunningMoments, got {type(other).__name__}")
        if other.num_segments != self.num_segments:
            raise ValueError(
                f"RunningMoments.merge: other has {other.num_segments} segments, this state has {self.num_segments}"
            )
        n, mean, m2 = chan_merge(
            self.count,
            self._mean,
            self.m2,
            other.count.to(self.device),
            other._mean.to(self.device),
            other.m2.to(self.device),
        )
        self._assign(n, mean, m2)
        return self

    def all_reduce(self, group=None) -> RunningMoments:
        """Merge the statistics of every rank of ``group``; afterwards all ranks hold identical states.

        Each rank all-gathers the ``[3, S]`` moments it gathered since the last ``all_reduce`` and merges
        them, in rank order, into the statistics shared at that sync: every rank performs the same float64
        operations in the same order, so the states end bitwise identical. Repeated calls never count a
        sample twice. Works with gloo (CPU states) and NCCL (CUDA states). A no-op when
        ``torch.distributed`` is not initialised. Every rank of the group must call it.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        base_n, base_mean, base_m2 = self._synced
        if bool((self.count < base_n).any()):
            raise ValueError(
                "RunningMoments.all_reduce: count is below the count at the last all_reduce; "
                "the state was replaced without load_state_dict"
            )
        local = torch.stack(chan_unmerge(self.count, self._mean, self.m2, base_n, base_mean, base_m2))
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local.contiguous(), group=group)
        n, mean, m2 = base_n.clone(), base_mean.clone(), base_m2.clone()
        for part in gathered:  # rank order: the same sequence of operations on every rank
            n, mean, m2 = chan_merge(n, mean, m2, part[0], part[1], part[2])
        self._assign(n, mean, m2)
        self._synced = torch.stack([n, mean, m2]).clone()
        return self

    def _assign(self, n, mean, m2) -> None:
        # copy_ rather than rebinding, so tensors handed out earlier (or captured by a compiled graph) follow.
        self.count.copy_(n)
        self._mean.copy_(mean)
        self.m2.copy_(m2)

    # -- checkpoints and devices ----------------------------------------------------------------------
    _KEYS = ("count", "mean", "m2", "synced")

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "count": self.count.clone(),
            "mean": self._mean.clone(),
            "m2": self.m2.clone(),
            "synced": self._synced.clone(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        unknown = set(state_dict) - set(self._KEYS)
        missing = {"count", "mean", "m2"} - set(state_dict)
        if unknown or missing:
            raise KeyError(
                f"RunningMoments.load_state_dict: missing keys {sorted(missing)}, unexpected keys {sorted(unknown)}"
            )
        S = self.num_segments
        for key in self._KEYS:
            if key not in state_dict:
                continue
            t = state_dict[key]
            want = (3, S) if key == "synced" else (S,)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = shape_str(t) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"RunningMoments.load_state_dict: state_dict['{key}'] has shape {got}, expected {list(want)}"
                )
        self._assign(state_dict["count"], state_dict["mean"], state_dict["m2"])
        if "synced" in state_dict:
            self._synced.copy_(state_dict["synced"])
        else:  # a checkpoint without sync information: nothing counts as shared yet
            self._synced.zero_()

    def to(self, device: torch.device | str) -> RunningMoments:
        """Move the statistics to ``device`` (in place, like ``nn.Module.to``); returns ``self``."""
        self.count = self.count.to(device)
        self._mean = self._mean.to(device)
        self.m2 = self.m2.to(device)
        self._synced = self._synced.to(device)
        return self

    def __repr__(self) -> str:
        def fmt(t: torch.Tensor) -> str:
            vals = t[:6].tolist()
            body = ", ".join(f"{v:.6g}" for v in vals)
            return f"[{body}{', ...' if t.numel() > 6 else ''}]"

        return (
            f"RunningMoments(num_segments={self.num_segments}, device={self.device}, count={fmt(self.count)}, "
            f"mean={fmt(self._mean)}, std={fmt(self.std)})"
        )


# ---- back ends ---------------------------------------------------------------------------------------
def check_values(rewards: torch.Tensor, segment_ids: torch.Tensor | None, num_segments: int) -> None:
    """The data checks of the native kernels, in eager torch: bad segment ids first, then NaN/inf."""
    if segment_ids is not None:
        bad = (segment_ids < 0) | (segment_ids >= num_segments)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(bad_segment_message(int(segment_ids[i]), i, num_segments))
    nonfinite = ~torch.isfinite(rewards)
    k = int(nonfinite.sum())
    if k:
        raise ValueError(nonfinite_message(k, int(nonfinite.nonzero()[0, 0]), rewards.numel(), rewards.dtype))


@_op.register("torch")
def _normalize_torch(rewards, segment_ids, count, mean, m2, clip: float, eps: float, update: bool) -> torch.Tensor:
    """Eager reference: bincount/index_add moments, Chan merge, normalise, clamp."""
    S = count.numel()
    check_values(rewards, segment_ids, S)
    if update:
        ids = segment_ids if segment_ids is not None else torch.zeros_like(rewards, dtype=torch.int64)
        batch = segment_moments(rewards.to(torch.float64), ids, S)
        n, new_mean, new_m2 = chan_merge(count, mean, m2, *batch)
        count.copy_(n)
        mean.copy_(new_mean)
        m2.copy_(new_m2)
    shift, scale = write_coefficients(count, mean, m2, eps, write_dtype(rewards.dtype))
    x = rewards.to(shift.dtype)
    if segment_ids is None:
        y = (x - shift[0]) * scale[0]
    else:
        y = (x - shift[segment_ids]) * scale[segment_ids]
    return y.clamp(-clip, clip).to(torch.float32)


@_op.register("cpp", CPU_LIBRARY)
def _normalize_cpp(rewards, segment_ids, count, mean, m2, clip: float, eps: float, update: bool) -> torch.Tensor:
    return torch.ops.palestra.normalize_rewards(rewards, segment_ids, count, mean, m2, clip, eps, update)


@_op.register("cuda", CUDA_LIBRARY)
def _normalize_cuda(rewards, segment_ids, count, mean, m2, clip: float, eps: float, update: bool) -> torch.Tensor:
    return torch.ops.palestra.normalize_rewards(rewards, segment_ids, count, mean, m2, clip, eps, update)


@_op.register("triton")
def _normalize_triton(rewards, segment_ids, count, mean, m2, clip: float, eps: float, update: bool) -> torch.Tensor:
    from . import triton_reward_norm  # imported only here: importing palestra.kernels must not import triton

    return triton_reward_norm.normalize_rewards_op(rewards, segment_ids, count, mean, m2, clip, eps, update)


def _register_fake() -> None:
    @torch.library.register_fake("palestra::normalize_rewards")
    def _(rewards, segment_ids, count, mean, m2, clip, eps, update):
        return rewards.new_empty(rewards.shape, dtype=torch.float32)


if CPU_LIBRARY.loaded:
    _register_fake()
else:
    CPU_LIBRARY.on_load(_register_fake)


# ---- public entry point ------------------------------------------------------------------------------
def _clip_value(clip) -> float:
    if clip is None:
        return math.inf
    if isinstance(clip, bool) or not isinstance(clip, (int, float)):
        raise TypeError(f"{OP}: clip must be a float > 0 or None, got {type(clip).__name__}")
    if not clip > 0:  # also catches NaN
        raise ValueError(f"{OP}: clip must be > 0 (None or inf for no clipping), got {clip}")
    return float(clip)


def _flat_segment_ids(segment_ids, rewards: torch.Tensor, num_segments: int) -> torch.Tensor | None:
    if segment_ids is None:
        if num_segments != 1:
            raise ValueError(f"{OP}: segment_ids is required when the state has S={num_segments} segments")
        return None
    check_tensor(OP, "segment_ids", segment_ids, dtypes=_INT_DTYPES)
    if segment_ids.shape != rewards.shape:
        raise ValueError(
            f"{OP}: segment_ids has shape {shape_str(segment_ids)}, expected the shape of rewards {shape_str(rewards)}"
        )
    if segment_ids.device != rewards.device:
        raise ValueError(f"{OP}: segment_ids is on {segment_ids.device}, rewards on {rewards.device}")
    return segment_ids.detach().reshape(-1).to(torch.int64).contiguous()


def normalize_rewards(
    rewards: torch.Tensor,
    state: RunningMoments,
    segment_ids: torch.Tensor | None = None,
    clip: float | None = 5.0,
    update: bool = True,
    eps: float = 1e-8,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Update ``state`` with ``rewards`` (if ``update``) and return them normalised and clipped.

    Args:
        rewards: any shape, float32/bfloat16/float16/float64. Must be finite.
        state: the running statistics, on the rewards' device; mutated in place when ``update``.
        segment_ids: integer tensor of the rewards' shape with values in ``[0, state.num_segments)``:
            each segment (agent) has its own statistics. Required when the state has several segments.
        clip: bound of the output's magnitude; ``None`` or ``inf`` for no clipping.
        update: fold the batch into ``state`` before normalising (Chan merge in float64).
        eps: added to the variance under the square root.
        backend: force one back end (``torch``, ``cpp``, ``cuda``, ``triton``) for this call; by default
            the device (and ``PALESTRA_KERNELS`` / :func:`palestra.kernels.set_backend`) chooses.

    Returns:
        float32 tensor of the rewards' shape: ``clamp((r - mean_s) / sqrt(var_s + eps), -clip, clip)``
        with the updated statistics of each reward's segment. A segment with no samples yet
        (``count == 0``) returns its rewards unnormalised, clipped.
    """
    check_tensor(OP, "rewards", rewards, dtypes=REWARD_DTYPES)
    if not isinstance(state, RunningMoments):
        raise TypeError(f"{OP}: state must be a RunningMoments, got {type(state).__name__}")
    if state.device != rewards.device:
        raise ValueError(
            f"{OP}: state is on {state.device} but rewards {shape_str(rewards)} ({dtype_name(rewards.dtype)}) "
            f"are on {rewards.device}; move it with state.to({str(rewards.device)!r})"
        )
    clip_value = _clip_value(clip)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 <= eps < math.inf):
        raise ValueError(f"{OP}: eps must be a finite float >= 0, got {eps!r}")
    seg = _flat_segment_ids(segment_ids, rewards, state.num_segments)
    flat = rewards.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        return torch.empty(rewards.shape, dtype=torch.float32, device=rewards.device)
    impl = _op(flat.device, backend)
    out = impl(flat, seg, state.count, state._mean, state.m2, clip_value, float(eps), bool(update))
    return out.view(rewards.shape)
