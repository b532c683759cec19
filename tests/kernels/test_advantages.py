"""Advantage estimators (gae, discounted_returns, group_advantages, rloo_advantages) on every back end
that runs here (torch, cpp, triton under the interpreter) against float64 oracles written in this file.

The CUDA kernels cannot run without a GPU; their warp algorithm is checked by compiling advantages.cu for
the host with a small emulation of warps and shuffles (test_cuda_kernels_under_host_emulation).
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import palestra.kernels as K
from palestra.kernels import advantages as A
from palestra.kernels.build import CPU_LIBRARY, KernelBuildError, csrc_dir

# ---------------------------------------------------------------------------------------------------
# float64 oracles, independent of palestra's references
# ---------------------------------------------------------------------------------------------------


def oracle_gae(r, v, m, boot, gamma, lam):
    """Per row: cut the padding out, run the textbook GAE loop over what is left, put results back."""
    r, v, m = r.double().tolist(), v.double().tolist(), m.bool().tolist()
    boot = boot.double().tolist()
    B, T = len(r), len(r[0]) if r else 0
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        steps = [t for t in range(T) if m[b][t]]
        next_value, next_adv = boot[b], 0.0
        for t in reversed(steps):
            delta = r[b][t] + gamma * next_value - v[b][t]
            next_adv = delta + gamma * lam * next_adv
            adv[b][t], ret[b][t] = next_adv, next_adv + v[b][t]
            next_value = v[b][t]
    f = lambda x: torch.tensor(x, dtype=torch.float64).reshape(B, T)  # noqa: E731
    return f(adv), f(ret)


def oracle_returns(r, m, gamma):
    r, m = r.double().tolist(), m.bool().tolist()
    B, T = len(r), len(r[0]) if r else 0
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        g = 0.0
        for t in reversed([t for t in range(T) if m[b][t]]):
            g = r[b][t] + gamma * g
            out[b][t] = g
    return torch.tensor(out, dtype=torch.float64).reshape(B, T)


def oracle_whiten(x, m, eps=1e-8):
    x, m = x.double(), m.bool()
    out = torch.zeros_like(x)
    sel = x[m]
    if sel.numel() >= 2:
        out[m] = (sel - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + eps)
    return out


def oracle_group(r, k, scale, eps):
    x = r.double().reshape(-1, k)
    centred = x - x.mean(1, keepdim=True)
    if scale == "group":
        std = x.std(1, keepdim=True, unbiased=True) if k > 1 else torch.zeros_like(x[:, :1])
        centred = centred / (std + eps)
    elif scale == "batch":
        std = r.double().std(unbiased=True) if r.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
        centred = centred / (std + eps)
    return centred.reshape(-1)


def oracle_rloo(r, k):
    x = r.double().reshape(-1, k)
    others = torch.stack([torch.cat([row[:i], row[i + 1 :]]).mean() for row in x for i in range(k)])
    return x.reshape(-1) - others


def assert_close(actual, expected, rel=1e-5, what=""):
    """Elementwise |a - e| <= rel * (|e| + scale of the data): relative to the data's magnitude, so
    values near a zero crossing are judged on the scale of the row, not on their own."""
    assert actual.dtype == torch.float32, f"{what}: output dtype {actual.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    e = expected.double()
    scale = e.abs().max().item() if e.numel() else 0.0
    err = (actual.double() - e).abs()
    bound = rel * (e.abs() + scale + 1e-30)
    worst = (err / bound).max().item() if e.numel() else 0.0
    assert worst <= 1.0, f"{what}: max error {err.max().item():.3g} exceeds {rel} relative (scale {scale:.3g})"


# ---------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------
MASK_KINDS = ("full", "right", "left", "gaps", "mixed")


def make_mask(B: int, T: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    t = torch.arange(T)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    if kind == "full":
        return torch.ones(B, T, dtype=torch.bool)
    if kind == "right":
        return t[None, :] < lengths[:, None]
    if kind == "left":
        return t[None, :] >= (T - lengths)[:, None]
    if kind == "gaps":
        return torch.rand(B, T, generator=gen) < 0.6
    # mixed: one row of each pattern, a fully masked row, left padding plus gaps inside
    rows = []
    for b in range(B):
        pattern = b % 5
        if pattern == 0:
            rows.append(torch.zeros(T, dtype=torch.bool))
        elif pattern == 1:
            rows.append(t < lengths[b])
        elif pattern == 2:
            rows.append(t >= T - lengths[b])
        elif pattern == 3:
            rows.append((t >= T // 3) & (torch.rand(T, generator=gen) < 0.7))
        else:
            rows.append(torch.ones(T, dtype=torch.bool))
    return torch.stack(rows)


def make_inputs(B: int, T: int, kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=gen)
    v = torch.randn(B, T, generator=gen) * 2 + 0.5
    boot = torch.randn(B, generator=gen)
    return r, v, make_mask(B, T, kind, gen), boot


_seed = iter(range(10_000, 1_000_000))


def fresh_seed() -> int:
    return next(_seed) + int(torch.randint(0, 1_000_000, ()).item())


# ---------------------------------------------------------------------------------------------------
# back ends
# ---------------------------------------------------------------------------------------------------
BACKENDS = ("torch", "cpp", "triton")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    name = request.param
    if name == "triton":
        pytest.importorskip("triton")
        from palestra.kernels import triton_advantages

        # Small tiles, so that tiny test rows still cross several tiles (the carries between them).
        monkeypatch.setattr(triton_advantages, "MAX_TILE", 16)
    K.set_backend(name)
    yield name
    K.set_backend(None)


@pytest.fixture
def cpp_backend():
    K.set_backend("cpp")
    yield "cpp"
    K.set_backend(None)


# Shapes per back end: the Triton interpreter is slow, so it gets the small ones.
GAE_SHAPES = {
    "torch": [(1, 1), (3, 1), (1, 37), (6, 45), (11, 130)],
    "cpp": [(1, 1), (3, 1), (1, 37), (6, 45), (11, 130), (37, 1000)],
    "triton": [(1, 1), (3, 1), (1, 37), (6, 45)],
}


def test_gae_matches_oracle(backend):
    for B, T in GAE_SHAPES[backend]:
        for kind in MASK_KINDS:
            r, v, m, boot = make_inputs(B, T, kind, fresh_seed())
            for gamma, lam, use_boot in [(0.99, 0.95, True), (1.0, 1.0, False)] + (
                [(0.0, 0.5, True), (0.8, 0.0, True)] if B * T < 1000 else []
            ):
                adv, ret = K.gae(r, v, m, gamma, lam, bootstrap_value=boot if use_boot else None)
                eadv, eret = oracle_gae(r, v, m, boot if use_boot else torch.zeros(B), gamma, lam)
                what = f"{backend} gae {B}x{T} {kind} gamma={gamma} lam={lam}"
                assert_close(adv, eadv, what=what + " advantages")
                assert_close(ret, eret, what=what + " returns")
                assert (adv[~m] == 0).all() and (ret[~m] == 0).all(), what + ": padding is not 0"


def test_gae_low_precision_and_numeric_mask(backend):
    B, T = (3, 20) if backend == "triton" else (7, 50)
    r, v, m, boot = make_inputs(B, T, "mixed", fresh_seed())
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        rd, vd, bd = r.to(dtype), v.to(dtype), boot.to(dtype)
        adv, ret = K.gae(rd, vd, m, 0.99, 0.95, bootstrap_value=bd)
        # the op computes in fp32 from the inputs as given: compare with the oracle on those inputs
        eadv, eret = oracle_gae(rd.float(), vd.float(), m, bd.float(), 0.99, 0.95)
        assert_close(adv, eadv, what=f"{backend} gae {dtype}")
        assert_close(ret, eret, what=f"{backend} gae {dtype} returns")
    ref = K.gae(r, v, m, 0.99, 0.95, bootstrap_value=boot)
    for numeric in (m.to(torch.int64), m.to(torch.float32), m.to(torch.uint8)):
        got = K.gae(r, v, numeric, 0.99, 0.95, bootstrap_value=boot)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_gae_one_row_and_bootstrap_forms(backend):
    T = 23
    r, v, m, boot = make_inputs(1, T, "gaps", fresh_seed())
    adv2, ret2 = K.gae(r, v, m, 0.97, 0.9, bootstrap_value=boot)
    for b in (boot[0], boot, float(boot[0])):  # 0-d tensor, [1] tensor, number
        adv1, ret1 = K.gae(r[0], v[0], m[0], 0.97, 0.9, bootstrap_value=b)
        assert adv1.shape == (T,) and ret1.shape == (T,)
        torch.testing.assert_close(adv1, adv2[0], rtol=0, atol=0)
        torch.testing.assert_close(ret1, ret2[0], rtol=0, atol=0)
    # a number bootstraps every row
    r, v, m, _ = make_inputs(4, 9, "right", fresh_seed())
    a, _ = K.gae(r, v, m, 0.9, 0.8, bootstrap_value=1.5)
    e, _ = oracle_gae(r, v, m, torch.full((4,), 1.5), 0.9, 0.8)
    assert_close(a, e, what="number bootstrap")


def test_gae_empty(backend):
    for B, T in [(0, 5), (4, 0)]:
        r = torch.zeros(B, T)
        adv, ret = K.gae(r, r, r > 0, 0.9, 0.9)
        assert adv.shape == (B, T) and ret.shape == (B, T)
        assert K.discounted_returns(r, r > 0, 0.9).shape == (B, T)


@pytest.mark.slow
def test_gae_exact_at_long_T(backend):
    """gamma * lam close to 1 at T = 4096: a float32 carry of a rounded gamma * lam drifts by ~1e-4 here."""
    T = 4096
    B = 1 if backend == "triton" else 3
    if backend == "triton":
        from palestra.kernels import triton_advantages

        triton_advantages.MAX_TILE = 1024  # the fixture restores it
    r, v, m, boot = make_inputs(B, T, "full", fresh_seed())
    m[:, :100] = False  # some left padding too
    gamma = lam = 0.9999
    adv, ret = K.gae(r, v, m, gamma, lam, bootstrap_value=boot)
    eadv, eret = A.gae_reference(r, v, m, boot, gamma, lam, dtype=torch.float64)
    assert_close(adv, eadv, rel=1e-5, what=f"{backend} gae T={T}")
    assert_close(ret, eret, rel=1e-5, what=f"{backend} gae returns T={T}")
    d = K.discounted_returns(r, m, 0.99995, whiten=False)
    assert_close(d, A.discounted_returns_reference(r, m, 0.99995), rel=1e-5, what=f"{backend} returns T={T}")


def test_discounted_returns(backend):
    for B, T in [(1, 1), (5, 1), (6, 29)] + ([] if backend == "triton" else [(13, 300)]):
        for kind in ("right", "left", "mixed"):
            r, _, m, _ = make_inputs(B, T, kind, fresh_seed())
            raw = K.discounted_returns(r, m, 0.95, whiten=False)
            expected = oracle_returns(r, m, 0.95)
            assert_close(raw, expected, what=f"{backend} returns {B}x{T} {kind}")
            white = K.discounted_returns(r, m, 0.95)
            assert_close(white, oracle_whiten(expected, m), what=f"{backend} whitened returns {B}x{T} {kind}")
            assert (white[~m] == 0).all()
    one = K.discounted_returns(r[0], m[0], 0.95, whiten=False)
    torch.testing.assert_close(one, raw[0], rtol=0, atol=0)
    r16 = r.to(torch.bfloat16)
    assert_close(K.discounted_returns(r16, m, 0.95, whiten=False), oracle_returns(r16.float(), m, 0.95), what="bf16")


def test_whitening_of_tiny_batches(backend):
    r = torch.tensor([[3.0, -1.0, 2.0]])
    assert torch.equal(K.discounted_returns(r, torch.zeros(1, 3, dtype=torch.bool), 0.9), torch.zeros(1, 3))
    one = K.discounted_returns(r, torch.tensor([[False, True, False]]), 0.9)
    assert torch.equal(one, torch.zeros(1, 3))  # a single valid step whitens to 0, not NaN


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages(backend, scale):
    for B, k in [(12, 3), (12, 1), (12, 12), (1, 1), (40, 5), (6, 2)]:
        r = torch.randn(B, generator=torch.Generator().manual_seed(fresh_seed())) * 3 + 1
        got = K.group_advantages(r, k, scale=scale, eps=1e-6)
        assert_close(got, oracle_group(r, k, scale, 1e-6), what=f"{backend} group_advantages {B}/{k} {scale}")
        if k == 1:
            assert torch.equal(got, torch.zeros(B))
    # equal rewards in a group: 0, not NaN
    same = torch.tensor([1.0, 1.0, 1.0, 2.0, 5.0, 8.0])
    got = K.group_advantages(same, 3, scale=scale)
    assert torch.isfinite(got).all() and torch.equal(got[:3], torch.zeros(3))
    # low precision inputs
    rb = torch.randn(16, generator=torch.Generator().manual_seed(fresh_seed())).to(torch.bfloat16)
    assert_close(K.group_advantages(rb, 4, scale=scale), oracle_group(rb.float(), 4, scale, 1e-6), what="bf16")


def test_rloo_advantages(backend):
    for B, k in [(12, 2), (12, 3), (12, 12), (35, 7)]:
        r = torch.randn(B, generator=torch.Generator().manual_seed(fresh_seed())) * 2
        assert_close(K.rloo_advantages(r, k), oracle_rloo(r, k), what=f"{backend} rloo {B}/{k}")
    rh = r.to(torch.float16)
    assert_close(K.rloo_advantages(rh, 7), oracle_rloo(rh.float(), 7), what="fp16")
    assert K.rloo_advantages(torch.zeros(0), 4).shape == (0,)


def test_inputs_requiring_grad_are_detached(backend):
    r, v, m, boot = make_inputs(2, 6, "right", fresh_seed())
    v.requires_grad_(True)
    adv, ret = K.gae(r, v, m, 0.9, 0.9, bootstrap_value=boot.requires_grad_(True))
    assert not adv.requires_grad and not ret.requires_grad
    g = torch.randn(6, requires_grad=True)
    assert not K.group_advantages(g, 3).requires_grad and not K.rloo_advantages(g, 3).requires_grad


# ---------------------------------------------------------------------------------------------------
# a peer: torchrl's vec GAE, on right-padded rows where the semantics coincide
# ---------------------------------------------------------------------------------------------------
def test_gae_agrees_with_torchrl_on_right_padding(cpp_backend):
    functional = pytest.importorskip("torchrl.objectives.value.functional")
    B, T, gamma, lam = 6, 40, 0.99, 0.95
    r, v, _, boot = make_inputs(B, T, "full", fresh_seed())
    lengths = torch.tensor([40, 1, 17, 39, 25, 8])
    m = torch.arange(T)[None, :] < lengths[:, None]
    adv, _ = K.gae(r, v, m, gamma, lam, bootstrap_value=boot)
    # torchrl: next value = V(t+1) inside a row, the bootstrap at the last valid step, and a "done"
    # (truncated, not terminated) flag there; padding steps are separate one-step trajectories.
    next_v = torch.cat([v[:, 1:], torch.zeros(B, 1)], 1)
    last = torch.arange(T)[None, :] == (lengths - 1)[:, None]
    next_v = torch.where(last, boot[:, None], next_v)
    done = last | ~m
    terminated = torch.zeros_like(done)
    theirs, _ = functional.vec_generalized_advantage_estimate(
        gamma, lam, v.unsqueeze(-1), next_v.unsqueeze(-1), r.unsqueeze(-1), done.unsqueeze(-1), terminated.unsqueeze(-1)
    )
    torch.testing.assert_close(adv[m], theirs.squeeze(-1)[m], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------
# torch.library integration
# ---------------------------------------------------------------------------------------------------
def _op_samples():
    r, v, m, boot = make_inputs(3, 11, "mixed", 7)
    return {
        "gae": (r, v, m, boot, 0.99, 0.95),
        "discounted_returns": (r, m, 0.97),
        "group_advantages": (torch.randn(12), 4, 1, 1e-6),
        "rloo_advantages": (torch.randn(12), 3),
    }


@pytest.mark.parametrize("name", ["gae", "discounted_returns", "group_advantages", "rloo_advantages"])
def test_opcheck_cpp(name):
    CPU_LIBRARY.load()
    args = _op_samples()[name]
    torch.library.opcheck(getattr(torch.ops.palestra, name).default, args)
    if name == "group_advantages":
        for scale in (0, 2):
            torch.library.opcheck(torch.ops.palestra.group_advantages.default, (args[0], 4, scale, 1e-6))


@pytest.mark.parametrize("name", ["gae", "discounted_returns", "group_advantages", "rloo_advantages"])
def test_opcheck_triton(name):
    pytest.importorskip("triton")
    from palestra.kernels import triton_advantages  # noqa: F401

    torch.library.opcheck(getattr(torch.ops.palestra_triton, name).default, _op_samples()[name])


@pytest.mark.parametrize("compile_backend", ["cpp", "triton"])
def test_compile_fullgraph(compile_backend):
    if compile_backend == "triton":
        pytest.importorskip("triton")

    def advantages_step(r, v, m, seq_rewards):
        adv, ret = K.gae(r, v, m, 0.99, 0.95)
        white = K.discounted_returns(r, m, 0.99)
        grpo = K.group_advantages(seq_rewards, 4, scale="group")
        rloo = K.rloo_advantages(seq_rewards, 4)
        return adv, ret, white, grpo, rloo

    r, v, m, _ = make_inputs(4, 16, "mixed", fresh_seed())
    seq = torch.randn(8)
    K.set_backend(compile_backend)
    try:
        compiled = torch.compile(advantages_step, fullgraph=True, backend="aot_eager")
        got_all = compiled(r, v, m, seq)
        want_all = advantages_step(r, v, m, seq)
    finally:
        K.set_backend(None)
    for got, want in zip(got_all, want_all):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------
_r, _v, _m = torch.zeros(2, 5), torch.zeros(2, 5), torch.ones(2, 5, dtype=torch.bool)
BAD_CALLS = [
    (lambda: K.gae(_r, torch.zeros(2, 4), _m, 0.9, 0.9), "values has shape [2, 4]"),
    (lambda: K.gae(_r, _v, torch.ones(3, 5, dtype=torch.bool), 0.9, 0.9), "mask has shape [3, 5]"),
    (lambda: K.gae(_r, _v, _m, 0.9, 0.9, bootstrap_value=torch.zeros(3)), "bootstrap_value has shape [3]"),
    (lambda: K.gae(_r[0], _v[0], _m[0], 0.9, 0.9, bootstrap_value=torch.zeros(2)), "bootstrap_value has shape [2]"),
    (lambda: K.gae(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.ones(2, 3, 4), 0.9, 0.9), "rewards has shape"),
    (lambda: K.gae(_r.long(), _v, _m, 0.9, 0.9), "rewards has dtype int64"),
    (lambda: K.gae(_r, _v.int(), _m, 0.9, 0.9), "values has dtype int32"),
    (lambda: K.gae(_r, _v, _m, 1.5, 0.9), "gamma must be in [0, 1], got 1.5"),
    (lambda: K.gae(_r, _v, _m, 0.9, -0.1), "lam must be in [0, 1], got -0.1"),
    (lambda: K.gae(_r, _v, _m, 0.9, float("nan")), "lam must be in [0, 1], got nan"),
    (lambda: K.gae(_r, _v, "mask", 0.9, 0.9), "mask must be a torch.Tensor"),
    (lambda: K.discounted_returns(_r, _m, 1.01), "gamma must be in [0, 1], got 1.01"),
    (lambda: K.discounted_returns(_r, _m[:, :3], 0.9), "mask has shape [2, 3]"),
    (lambda: K.group_advantages(torch.zeros(10), 3), "group_size 3 does not divide the batch size 10"),
    (lambda: K.group_advantages(torch.zeros(10), 0), "group_size must be >= 1, got 0"),
    (lambda: K.group_advantages(torch.zeros(10), 5, scale="std"), "unknown scale 'std'"),
    (lambda: K.group_advantages(torch.zeros(10), 5, eps=0.0), "eps must be > 0"),
    (lambda: K.group_advantages(torch.zeros(2, 5), 5), "rewards has shape [2, 5]"),
    (lambda: K.rloo_advantages(torch.zeros(10), 1), "group_size must be >= 2, got 1"),
    (lambda: K.rloo_advantages(torch.zeros(10), 4), "group_size 4 does not divide the batch size 10"),
]


@pytest.mark.parametrize("call,message", BAD_CALLS, ids=[m for _, m in BAD_CALLS])
def test_bad_inputs_raise_one_line_errors(call, message):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text, text


def test_cpp_kernels_check_their_inputs_too():
    CPU_LIBRARY.load()
    with pytest.raises(RuntimeError, match="group_size 3 does not divide the batch size 10"):
        torch.ops.palestra.group_advantages(torch.zeros(10), 3, 1, 1e-6)
    with pytest.raises(RuntimeError, match="mask has dtype"):
        torch.ops.palestra.gae(_r, _v, _m.float(), torch.zeros(2), 0.9, 0.9)
    with pytest.raises(RuntimeError, match="lam must be in"):
        torch.ops.palestra.gae(_r, _v, _m, torch.zeros(2), 0.9, 2.0)


# ---------------------------------------------------------------------------------------------------
# back-end choice
# ---------------------------------------------------------------------------------------------------
def test_backend_forcing(monkeypatch):
    r, v, m, boot = make_inputs(3, 8, "gaps", fresh_seed())
    K.set_backend(None)
    try:
        monkeypatch.setenv("PALESTRA_KERNELS", "torch")
        assert A._gae.backend_for(r.device) == "torch"
        by_torch = K.gae(r, v, m, 0.9, 0.8, bootstrap_value=boot)
        monkeypatch.setenv("PALESTRA_KERNELS", "cpp")
        assert A._gae.backend_for(r.device) == "cpp"
        by_cpp = K.gae(r, v, m, 0.9, 0.8, bootstrap_value=boot)
        torch.testing.assert_close(by_cpp, by_torch, rtol=1e-6, atol=1e-6)
        monkeypatch.delenv("PALESTRA_KERNELS")
        assert A._group.backend_for(r.device) == "cpp"  # automatic choice on CPU
        K.set_backend("cuda")  # forced, but it cannot serve CPU tensors: an error, not a fallback
        with pytest.raises(KernelBuildError, match="cuda"):
            K.gae(r, v, m, 0.9, 0.8)
        with pytest.raises(KernelBuildError, match="cuda"):
            K.rloo_advantages(torch.zeros(4), 2)
    finally:
        K.set_backend(None)


# ---------------------------------------------------------------------------------------------------
# the CUDA kernels' warp algorithm, run on the host
# ---------------------------------------------------------------------------------------------------
# Every CUDA feature advantages.cu uses, emulated: a block's threads are real threads, a warp shuffle is
# an exchange through a buffer between two barriers, shared memory is static storage (blocks run one
# after another). exp2f is the exact libm one (the GPU's is approximate to ~2 ulp).
_EMULATION = r"""
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
typedef void* cudaStream_t;
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

namespace emu {
struct Warp {
  std::barrier<> bar{32};
  alignas(8) unsigned char buf[32][8];
};
struct Block {
  std::barrier<> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  explicit Block(unsigned n) : bar(n) {
    for (unsigned w = 0; w < (n + 31) / 32; ++w) warps.emplace_back(new Warp);
  }
};
inline thread_local dim3 tid, bid, bdim;
inline thread_local Block* block = nullptr;
inline thread_local Warp* warp = nullptr;
inline thread_local int lane = 0;

template <class T>
T exchange(T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffle of a wide type");
  std::memcpy(warp->buf[lane], &v, sizeof(T));
  warp->bar.arrive_and_wait();
  T out;
  std::memcpy(&out, warp->buf[src], sizeof(T));
  warp->bar.arrive_and_wait();
  return out;
}

template <class F>
void launch(dim3 grid, dim3 blockdim, F body) {
  for (unsigned b = 0; b < grid.x; ++b) {
    Block blk(blockdim.x);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < blockdim.x; ++t) {
      threads.emplace_back([&, t] {
        tid = dim3(t);
        bid = dim3(b);
        bdim = blockdim;
        block = &blk;
        warp = blk.warps[t / 32].get();
        lane = t % 32;
        body();
      });
    }
    for (auto& th : threads) th.join();
  }
}
}  // namespace emu

#define threadIdx emu::tid
#define blockIdx emu::bid
#define blockDim emu::bdim
template <class T> T __shfl_up_sync(unsigned, T v, int off) {
  return emu::exchange(v, emu::lane >= off ? emu::lane - off : emu::lane);
}
template <class T> T __shfl_xor_sync(unsigned, T v, int m) { return emu::exchange(v, emu::lane ^ m); }
template <class T> T __shfl_sync(unsigned, T v, int src) { return emu::exchange(v, src); }
inline void __syncthreads() { emu::block->bar.arrive_and_wait(); }
"""

_EMULATION_MAIN = r"""
#include "advantages_host.cpp"
extern "C" int emu_reverse_scan(const float* r, const float* v, const uint8_t* m, const float* boot, float* adv,
                                float* ret, int64_t B, int64_t T, float gamma, float c, float log2c) {
  return palestra::cuda::launch_reverse_scan(r, v, m, boot, adv, ret, B, T, gamma, c, log2c, nullptr);
}
extern "C" int emu_group(const float* r, float* out, float* ws, int64_t B, int64_t k, int mode, float eps) {
  return palestra::cuda::launch_group_advantages(r, out, ws, B, k, mode, eps, nullptr);
}
"""

_LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^<>]*>)?)\s*<<<(.*?)>>>\s*\((.*?)\);", re.S)


def _build_host_emulation(out: Path) -> ctypes.CDLL:
    cu_dir = csrc_dir() / "cuda"
    (out / "cuda_runtime.h").write_text(_EMULATION)

    def as_host_launch(m: re.Match) -> str:
        grid, block = (s.strip() for s in m.group(2).split(",")[:2])
        return f"emu::launch(dim3({grid}), dim3({block}), [&] {{ {m.group(1)}({m.group(3)}); }});"

    source, launches = _LAUNCH.subn(as_host_launch, (cu_dir / "advantages.cu").read_text())
    assert launches >= 3, "advantages.cu: kernel launches not found"
    (out / "advantages_host.cpp").write_text(source)
    (out / "main.cpp").write_text(_EMULATION_MAIN)
    so = out / "advantages_host.so"
    cmd = [
        "g++",
        "-std=c++20",
        "-O1",
        "-pthread",
        "-shared",
        "-fPIC",
        "-fno-gnu-unique",
        "-I",
        str(out),
        "-I",
        str(cu_dir),
    ]
    proc = subprocess.run([*cmd, str(out / "main.cpp"), "-o", str(so)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = ctypes.CDLL(str(so))
    P, I64, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.emu_reverse_scan.argtypes = [P, P, P, P, P, P, I64, I64, F, F, F]
    lib.emu_group.argtypes = [P, P, P, I64, I64, ctypes.c_int, F]
    return lib


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
@pytest.mark.slow
def test_cuda_kernels_under_host_emulation(tmp_path):
    lib = _build_host_emulation(tmp_path)

    def log2_floor(c):  # as advantages_binding.cpp passes it
        return max(math.log2(c), -1e4) if c > 0 else -1e4

    # T = 600 crosses three 256-step tiles; T = 7 leaves most lanes of the only tile out of range.
    for B, T in [(6, 600), (5, 7), (1, 1)]:
        r, v, m, boot = make_inputs(B, T, "mixed", fresh_seed())
        for gamma, lam in [(0.99, 0.95), (1.0, 1.0), (0.0, 0.5), (0.8, 0.0)]:
            adv, ret, out = (torch.full((B, T), 7.0) for _ in range(3))
            c = gamma * lam
            rc = lib.emu_reverse_scan(
                r.data_ptr(),
                v.data_ptr(),
                m.data_ptr(),
                boot.data_ptr(),
                adv.data_ptr(),
                ret.data_ptr(),
                B,
                T,
                gamma,
                c,
                log2_floor(c),
            )
            assert rc == 0
            eadv, eret = oracle_gae(r, v, m, boot, gamma, lam)
            assert_close(adv, eadv, what=f"cuda(emulated) gae {B}x{T} {gamma} {lam}")
            assert_close(ret, eret, what=f"cuda(emulated) gae returns {B}x{T} {gamma} {lam}")
            rc = lib.emu_reverse_scan(
                r.data_ptr(), None, m.data_ptr(), None, out.data_ptr(), None, B, T, gamma, gamma, log2_floor(gamma)
            )
            assert rc == 0
            assert_close(out, oracle_returns(r, m, gamma), what=f"cuda(emulated) returns {B}x{T} {gamma}")
    workspace = torch.zeros(1)
    for B, k in [(24, 4), (24, 1), (24, 24), (70, 35)]:
        r = torch.randn(B, generator=torch.Generator().manual_seed(fresh_seed()))
        for mode, scale in enumerate(("none", "group", "batch", "rloo")):
            if scale == "rloo" and k < 2:
                continue
            out = torch.full((B,), 7.0)
            assert lib.emu_group(r.data_ptr(), out.data_ptr(), workspace.data_ptr(), B, k, mode, 1e-6) == 0
            expected = oracle_rloo(r, k) if scale == "rloo" else oracle_group(r, k, scale, 1e-6)
            assert_close(out, expected, what=f"cuda(emulated) {scale} {B}/{k}")
    assert lib.emu_group(r.data_ptr(), out.data_ptr(), workspace.data_ptr(), 10, 3, 1, 1e-6) != 0


# ---------------------------------------------------------------------------------------------------
# the Triton kernels compile for a GPU (the interpreter above does not type-check them)
# ---------------------------------------------------------------------------------------------------
_TRITON_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from palestra.kernels import triton_advantages as TA


def compile_kernel(fn, signature, constexprs):
    names = list(fn.arg_names)
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


f32p = "*fp32"
scan = dict(
    r_ptr=f32p, v_ptr=f32p, m_ptr="*u8", boot_ptr=f32p, adv_ptr=f32p, ret_ptr=f32p, T="i32", gamma="fp32", log2c="fp32"
)
for has_values in (True, False):
    compile_kernel(TA._reverse_scan_kernel, scan, dict(HAS_VALUES=has_values, BLOCK=1024))
compile_kernel(TA._batch_std_kernel, dict(r_ptr=f32p, out_ptr=f32p, N="i32"), dict(BLOCK=1024))
group = dict(r_ptr=f32p, out_ptr=f32p, std_ptr=f32p, group_size="i32", eps="fp32", factor="fp32")
for mode in range(4):
    compile_kernel(TA._group_kernel, group, dict(MODE=mode, BLOCK=64))
print("compiled")
"""


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90(tmp_path):
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("triton's NVIDIA back end (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    proc = subprocess.run([sys.executable, "-c", _TRITON_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
