"""Benchmark cases for normalize_rewards: our back ends and two eager baselines, measured in the same run.

``cases(device, quick)`` returns rows for ``palestra bench``, bench/gpu_check.py and
bench/test_bench_reward_norm.py. Each row's ``fn`` runs one call that updates the running statistics with
a batch and returns the normalised, clipped rewards.

Baselines (our own eager code, modelled on what RL libraries do; none of it copied):

* ``torch-eager``: the straightforward eager version: float64 batch moments (mean, then squared
  deviations; bincount/index_add per segment), Chan merge into float64 running tensors, normalise, clamp.
* ``trl-style``: the running-moments tracker as TRL/OpenRLHF write it: Python-float state updated from
  the batch's mean and population variance (``.item()`` syncs), then ``(x - mean) / std`` and clamp;
  with segments, one tracker per agent fed by a boolean mask, which is how that class is used per agent.
"""

from __future__ import annotations

import math

import torch

OP = "normalize_rewards"
SIZES = {"64K": 1 << 16, "1M": 1 << 20, "16M": 1 << 24}
SEGMENTS = (1, 8)


class EagerRewardNorm:
    """Straightforward eager torch: per-segment float64 moments, Chan merge, normalise, clamp."""

    def __init__(self, num_segments: int, device: str):
        self.S = num_segments
        z = lambda: torch.zeros(num_segments, dtype=torch.float64, device=device)  # noqa: E731
        self.count, self.mean, self.m2 = z(), z(), z()

    def __call__(self, rewards, segment_ids=None, clip: float = 5.0, eps: float = 1e-8):
        x = rewards.reshape(-1).double()
        if segment_ids is None:
            # mean, then squared deviations: two passes. (torch.var_mean is Welford, with a division per
            # element, and 5-10x slower on CPU: the stronger baseline is the one measured.)
            b_mean = x.mean().reshape(1)
            b_m2 = ((x - b_mean) ** 2).sum().reshape(1)
            b_n = torch.full((1,), float(x.numel()), dtype=torch.float64, device=x.device)
        else:
            s = segment_ids.reshape(-1)
            b_n = torch.bincount(s, minlength=self.S).double()
            b_mean = torch.zeros_like(self.mean).index_add_(0, s, x) / b_n.clamp(min=1)
            d = x - b_mean[s]
            b_m2 = torch.zeros_like(self.m2).index_add_(0, s, d * d)
        n = self.count + b_n
        delta = b_mean - self.mean
        self.mean = self.mean + delta * b_n / n
        self.m2 = self.m2 + b_m2 + delta * delta * self.count * b_n / n
        self.count = n
        std = torch.sqrt(self.m2 / self.count + eps).float()
        mean = self.mean.float()
        r = rewards.reshape(-1).float()
        if segment_ids is None:
            out = (r - mean) / std
        else:
            out = (r - mean[s]) / std[s]
        return out.clamp(-clip, clip).reshape(rewards.shape)


class TrlStyleMoments:
    """A running mean/std tracker in the style of TRL's and OpenRLHF's: Python floats, batch mean/var."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        xs_count = xs.numel()
        xs_mean = xs.mean()
        xs_var = ((xs - xs_mean) ** 2).mean()
        xs_mean, xs_var = xs_mean.item(), xs_var.item()
        delta = xs_mean - self.mean
        total = self.count + xs_count
        old_sum = self.var * self.count + delta**2 * self.count * xs_count / total
        self.mean += delta * xs_count / total
        self.var = (old_sum + xs_var * xs_count) / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.var * self.count / (self.count - 1)) if self.count > 1 else 1.0


class TrlStyleRewardNorm:
    """One tracker per segment (agent); update, then normalise and clamp."""

    def __init__(self, num_segments: int):
        self.trackers = [TrlStyleMoments() for _ in range(num_segments)]

    def __call__(self, rewards, segment_ids=None, clip: float = 5.0, eps: float = 1e-8):
        r = rewards.reshape(-1).float()
        if segment_ids is None:
            t = self.trackers[0]
            t.update(r)
            return ((r - t.mean) / (t.std + eps)).clamp(-clip, clip).reshape(rewards.shape)
        s = segment_ids.reshape(-1)
        out = torch.empty_like(r)
        for k, t in enumerate(self.trackers):
            mask = s == k
            xk = r[mask]
            if xk.numel():
                t.update(xk)
                out[mask] = ((xk - t.mean) / (t.std + eps)).clamp(-clip, clip)
        return out.reshape(rewards.shape)


def _inputs(n: int, S: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(n, generator=g) * 2.0 + 3.0).to(device)
    seg = torch.randint(0, S, (n,), generator=g).to(device) if S > 1 else None
    return r, seg


def _ours(backend: str, r, seg, S: int, device: str):
    from palestra.kernels import RunningMoments, normalize_rewards

    state = RunningMoments(S, device=device)
    return lambda: normalize_rewards(r, state, segment_ids=seg, backend=backend)


def cases(device: str, quick: bool) -> list[dict]:
    """Rows for every size x segment count: our back ends for ``device`` and the eager baselines."""
    sizes = ["64K"] if quick else ["64K", "1M"]
    ours = ["cuda", "triton"] if device == "cuda" else ["cpp"]
    rows: list[dict] = []
    for size in sizes:
        n = SIZES[size]
        for S in SEGMENTS:
            r, seg = _inputs(n, S, device)
            label = f"{size} S={S}"
            moved = n * r.element_size() + 4 * n + (8 * n if seg is not None else 0)
            for backend in ours:
                rows.append(
                    {
                        "op": OP,
                        "size": label,
                        "impl": backend,
                        "fn": _ours(backend, r, seg, S, device),
                        "baseline": False,
                        "bytes": moved,
                    }
                )
            eager, trl = EagerRewardNorm(S, device), TrlStyleRewardNorm(S)
            rows.append(
                {
                    "op": OP,
                    "size": label,
                    "impl": "torch-eager",
                    "fn": lambda e=eager, r=r, s=seg: e(r, s),
                    "baseline": True,
                    "bytes": moved,
                }
            )
            rows.append(
                {
                    "op": OP,
                    "size": label,
                    "impl": "trl-style",
                    "fn": lambda t=trl, r=r, s=seg: t(r, s),
                    "baseline": True,
                    "bytes": moved,
                }
            )
    return rows
