"""Benchmark cases for the advantage estimators (used by ``palestra bench`` and bench/test_bench_advantages.py).

``cases(device, quick)`` returns one dict per (op, size, implementation): ``fn`` runs one call. Baselines,
measured in the same run:

* ``torchrl-vec``: torchrl's ``vec_generalized_advantage_estimate`` (a truncated-filter convolution; its
  inputs, [B, T, 1] with next values and done flags, are prepared outside the timed call). It raises
  ImportError when torchrl is not installed (the bench reports the row as an error).
* ``verl-loop``: a Python loop over time written here in the style of verl's
  ``compute_gae_advantage_return`` (vectorised over rows, carries held through padding), and the
  same for REINFORCE++ returns.
* ``torch-eager``: eager torch for the group ops (view into groups, mean/std, as TRL / verl write it).

Inputs are right-padded (random lengths in [T/2, T]) with zero rewards at padding, where all the
implementations mean the same thing; bench/test_bench_advantages.py checks that they agree.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import palestra.kernels as K
from palestra.kernels import dispatch

GAMMA, LAM = 0.99, 0.95


@contextmanager
def forced_backend(name: str):
    previous = dispatch._forced  # restore exactly what was forced before (None = automatic)
    dispatch.set_backend(name)
    try:
        yield
    finally:
        dispatch.set_backend(previous)


def ours(backend: str, fn):
    """Run ``fn`` (a call of the public API) with ``backend`` forced."""

    def run():
        with forced_backend(backend):
            return fn()

    return run


# ---- inputs -------------------------------------------------------------------------------------------
def sequences(B: int, T: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = torch.randn(B, T, generator=gen) * mask
    values = torch.randn(B, T, generator=gen)
    return rewards.to(device), values.to(device), mask.to(device)


def torchrl_inputs(rewards, values, mask):
    """torchrl's [B, T, 1] layout: next values, and done = terminated at each row's last valid step (a
    terminal end: bootstrap value 0). The padding after it ends at T - 1 as a trajectory of its own (its
    outputs are ignored); flagging every padding step instead would split it into one-step trajectories,
    which torchrl pads to T each (a ~T-fold slowdown that says nothing about GAE itself)."""
    B, T = rewards.shape
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    lengths = mask.sum(1)
    steps = torch.arange(T, device=mask.device)[None, :]
    last = steps == (lengths - 1)[:, None]
    done = last | (steps == T - 1)
    return tuple(x.unsqueeze(-1) for x in (values, next_values, rewards, done, last))


def torchrl_gae():
    try:
        from torchrl.objectives.value.functional import vec_generalized_advantage_estimate
    except ImportError as e:
        raise ImportError(f"torchrl is not installed ({e}); pip install torchrl tensordict") from None
    return vec_generalized_advantage_estimate


# ---- baselines written here ---------------------------------------------------------------------------
@torch.no_grad()
def verl_style_gae(rewards, values, mask, gamma: float, lam: float):
    """The reverse loop over time that verl's compute_gae_advantage_return runs (our own code)."""
    B, T = rewards.shape
    m = mask.to(values.dtype)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    last_adv = torch.zeros_like(next_value)
    reversed_advs = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        # padding: keep the carries of the next valid step
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last_adv = adv_t * m[:, t] + (1 - m[:, t]) * last_adv
        reversed_advs.append(last_adv)
    advantages = torch.stack(reversed_advs[::-1], dim=1)
    return advantages, advantages + values


def masked_whiten_eager(x, mask, eps: float = 1e-8):
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps) * m


@torch.no_grad()
def verl_style_returns(rewards, mask, gamma: float):
    """REINFORCE++ returns as verl writes them: a reverse loop, reset at padding, then masked whitening."""
    B, T = rewards.shape
    m = mask.to(rewards.dtype)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    out = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
        running = running * m[:, t]
    return masked_whiten_eager(out, mask)


def eager_group(rewards, k: int, scale: str, eps: float = 1e-6):
    g = rewards.view(-1, k)
    centred = g - g.mean(1, keepdim=True)
    if scale == "group":
        centred = centred / (g.std(1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std() + eps)
    return centred.view(-1)


def eager_rloo(rewards, k: int):
    g = rewards.view(-1, k)
    return (g - (g.sum(1, keepdim=True) - g) / (k - 1)).view(-1)


# ---- cases --------------------------------------------------------------------------------------------
def native_backends(device: str) -> list[str]:
    return ["cuda", "triton"] if device == "cuda" else ["cpp"]


def gae_sizes(device: str, quick: bool, big: bool = False) -> list[tuple[int, int]]:
    if big:
        return [(1024, 8192)] if device == "cuda" else [(1024, 4096)]
    if quick:
        return [(64, 256)]
    return [(256, 1024), (1024, 4096)] if device == "cuda" else [(256, 1024)]


def group_sizes(device: str, quick: bool, big: bool = False) -> list[tuple[int, int]]:
    if big:
        return [(1 << 20, 64)] if device == "cuda" else [(65536, 64)]
    if quick:
        return [(1024, 8)]
    return [(8192, 16), (65536, 64)] if device == "cuda" else [(8192, 16)]


def cases(device: str, quick: bool, big: bool = False) -> list[dict]:
    """All cases at the default sizes (``quick``: small ones; ``big``: only sizes past the defaults)."""
    out: list[dict] = []
    for B, T in gae_sizes(device, quick, big):
        r, v, m = sequences(B, T, device)
        size = f"B={B} T={T}"
        gae_bytes = B * T * (4 + 4 + 1 + 4 + 4)
        for backend in native_backends(device):
            out.append(dict(op="gae", size=size, impl=backend, baseline=False, bytes=gae_bytes,
                            fn=ours(backend, lambda r=r, v=v, m=m: K.gae(r, v, m, GAMMA, LAM))))
        rl = torchrl_inputs(r, v, m)

        def run_torchrl(rl=rl):
            return torchrl_gae()(GAMMA, LAM, *rl)

        out.append(dict(op="gae", size=size, impl="torchrl-vec", baseline=True, bytes=gae_bytes, fn=run_torchrl))
        out.append(dict(op="gae", size=size, impl="verl-loop", baseline=True, bytes=gae_bytes,
                        fn=lambda r=r, v=v, m=m: verl_style_gae(r, v, m, GAMMA, LAM)))

        ret_bytes = B * T * (4 + 1 + 4)
        for backend in native_backends(device):
            out.append(dict(op="discounted_returns", size=size, impl=backend, baseline=False, bytes=ret_bytes,
                            fn=ours(backend, lambda r=r, m=m: K.discounted_returns(r, m, GAMMA))))
        out.append(dict(op="discounted_returns", size=size, impl="verl-loop", baseline=True, bytes=ret_bytes,
                        fn=lambda r=r, m=m: verl_style_returns(r, m, GAMMA)))

    for B, k in group_sizes(device, quick, big):
        rewards = torch.randn(B, generator=torch.Generator().manual_seed(1)).to(device)
        size = f"B={B} group={k}"
        for scale in ("group", "none"):
            op = f"group_advantages[{scale}]"
            for backend in native_backends(device):
                out.append(dict(op=op, size=size, impl=backend, baseline=False, bytes=8 * B,
                                fn=ours(backend, lambda x=rewards, k=k, s=scale: K.group_advantages(x, k, scale=s))))
            out.append(dict(op=op, size=size, impl="torch-eager", baseline=True, bytes=8 * B,
                            fn=lambda x=rewards, k=k, s=scale: eager_group(x, k, s)))
        for backend in native_backends(device):
            out.append(dict(op="rloo_advantages", size=size, impl=backend, baseline=False, bytes=8 * B,
                            fn=ours(backend, lambda x=rewards, k=k: K.rloo_advantages(x, k))))
        out.append(dict(op="rloo_advantages", size=size, impl="torch-eager", baseline=True, bytes=8 * B,
                        fn=lambda x=rewards, k=k: eager_rloo(x, k)))
    return out
