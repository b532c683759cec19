#!/usr/bin/env python
"""Build, check and time every GPU back end (CUDA and Triton) in one run.

Made for a session that is lent a GPU for a few minutes: one call builds the CUDA library, checks each op
and back end against a float64 reference on fresh random inputs (awkward shapes and bf16 included),
measures the device's copy bandwidth, times every case from ``bench/cases_*.py`` and prints achieved GB/s
as a fraction of that bandwidth. With ``--device cpu`` the same script checks the cpp back end and, under
``TRITON_INTERPRET=1``, the Triton kernels, on small shapes (CI runs it that way as a smoke test).

    python bench/gpu_check.py                       # on a GPU machine
    python bench/gpu_check.py --out results.json    # also keep the figures
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


# ---- float64 references, written independently of palestra.kernels ------------------------------------
def ref_logprob_entropy(logits, tokens, temperature, ignore_index):
    z = logits.double() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    valid = tokens != ignore_index
    safe = torch.where(valid, tokens, torch.zeros_like(tokens))
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, ent, 0.0)


def ref_gae(rewards, values, mask, gamma, lam, bootstrap):
    r, v, m = rewards.double(), values.double(), mask.bool()
    B, T = r.shape
    adv = torch.zeros_like(r)
    next_v = bootstrap.double().clone()
    last = torch.zeros(B, dtype=torch.float64, device=r.device)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * last
        adv[:, t] = torch.where(m[:, t], a, 0.0)
        last = torch.where(m[:, t], a, last)
        next_v = torch.where(m[:, t], v[:, t], next_v)
    return adv, torch.where(m, adv + v, 0.0)


def ref_group(rewards, g, scale):
    r = rewards.double().view(-1, g)
    a = r - r.mean(1, keepdim=True)
    if scale == "group":
        a = a / (r.std(1, keepdim=True) + 1e-6) if g > 1 else a
    elif scale == "batch":
        a = a / (rewards.double().std() + 1e-6)
    return a.reshape(-1)


def ref_rloo(rewards, g):
    r = rewards.double().view(-1, g)
    return (r - (r.sum(1, keepdim=True) - r) / (g - 1)).reshape(-1)


def ref_normalize(rewards, seg, S, clip):
    out = torch.empty_like(rewards, dtype=torch.float64)
    r = rewards.double()
    for s in range(S):
        sel = seg == s
        x = r[sel]
        if x.numel():
            mean, var = x.mean(), x.var(unbiased=False)
            out[sel] = ((x - mean) / torch.sqrt(var + 1e-8)).clamp(-clip, clip)
    return out


# ---- checks ---------------------------------------------------------------------------------------------
def _close(name, got, want, rtol, atol, failures):
    got, want = got.double().cpu(), want.double().cpu()
    err = (got - want).abs()
    tol = atol + rtol * want.abs()
    ok = bool((err <= tol).all()) and bool(torch.isfinite(got).all())
    print(f"    {'ok ' if ok else 'BAD'} {name:<58} max abs err {err.max().item():.3g}")
    if not ok:
        failures.append(name)


def check_backend(backend: str, device: str, small: bool) -> list[str]:
    """Run every op on ``backend`` against the float64 references; return the failed checks' names."""
    from palestra import kernels as K

    failures: list[str] = []
    g = torch.Generator(device="cpu").manual_seed(1234)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    K.set_backend(backend)
    try:
        # logprob_entropy: V not a power of two, one row, fully masked rows, bf16, temperature
        shapes = [(5, 257), (1, 1000), (3, 50)] if small else [(64, 32000), (1, 151936), (257, 4097), (8, 1000)]
        for N, V in shapes:
            for dtype in (torch.float32, torch.bfloat16):
                logits = (randn(N, V) * 3).to(dtype).requires_grad_(True)
                tokens = torch.randint(0, V, (N,), generator=g).to(device)
                tokens[N // 2] = -100
                if N >= 3:
                    tokens[0] = -100  # some fully ignored rows
                temp = 0.7
                logp, ent = K.logprob_entropy(logits, tokens, temperature=temp)
                rl = logits.detach().double().requires_grad_(True)
                rlogp, rent = ref_logprob_entropy(rl, tokens, temp, -100)
                tol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
                _close(f"logprob_entropy logp {N}x{V} {dtype}", logp, rlogp, *tol, failures)
                _close(f"logprob_entropy entropy {N}x{V} {dtype}", ent, rent, *tol, failures)
                gl, ge = randn(N), randn(N)
                (logp * gl + ent * ge).sum().backward()
                (rlogp * gl.double() + rent * ge.double()).sum().backward()
                _close(f"logprob_entropy grad {N}x{V} {dtype}", logits.grad, rl.grad, tol[0], tol[1] * 0.1, failures)
                if bool((logp > 0).any()):
                    failures.append(f"logprob_entropy logp > 0 {N}x{V} {dtype}")
        # gae with padding on either side and gaps; T=1 and B=1 included
        for B, T in [(3, 7), (1, 1), (2, 33)] if small else [(256, 1024), (1, 1), (7, 4099)]:
            r, v = randn(B, T), randn(B, T)
            mask = torch.rand(B, T, generator=g).to(device) > 0.2
            mask[0] = False  # a fully masked row
            boot = randn(B)
            adv, ret = K.gae(r, v, mask, 0.99, 0.95, bootstrap_value=boot)
            radv, rret = ref_gae(r, v, mask, 0.99, 0.95, boot)
            _close(f"gae advantages {B}x{T}", adv, radv, 1e-5, 1e-4, failures)
            _close(f"gae returns {B}x{T}", ret, rret, 1e-5, 1e-4, failures)
        for G, n in [(3, 4), (1, 2)] if small else [(4096, 16), (1, 2), (1000, 7)]:
            r = randn(G * n) * 2 + 1
            for scale in ("group", "batch", "none"):
                _close(
                    f"group_advantages {G}x{n} {scale}",
                    K.group_advantages(r, n, scale=scale),
                    ref_group(r, n, scale),
                    1e-4,
                    1e-4,
                    failures,
                )
            _close(f"rloo_advantages {G}x{n}", K.rloo_advantages(r, n), ref_rloo(r, n), 1e-5, 1e-5, failures)
        for N, S in [(10, 1), (7, 3)] if small else [(1 << 20, 1), (1_000_003, 5)]:
            r = randn(N) * 2 + 3
            seg = torch.randint(0, S, (N,), generator=g).to(device)
            state = K.RunningMoments(num_segments=S, device=device)
            out = K.normalize_rewards(r, state, segment_ids=seg if S > 1 else None, clip=5.0)
            _close(
                f"normalize_rewards {N} segments={S}",
                out,
                ref_normalize(r, seg if S > 1 else torch.zeros_like(seg), S, 5.0),
                1e-4,
                1e-4,
                failures,
            )
    except Exception as e:  # noqa: BLE001 - a crash is a failed check, reported with its reason, and the run goes on
        traceback.print_exc()
        failures.append(f"{backend}: crashed: {type(e).__name__}: {e}".splitlines()[0])
    finally:
        K.set_backend(None)
    return failures


# ---- timing ---------------------------------------------------------------------------------------------
def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy (read + write), the practical ceiling for our ops."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    seconds = timed(lambda: y.copy_(x), device)
    return 2 * n / seconds


def timed(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    from palestra.cli.bench import time_call

    return time_call(fn, device, min_time=0.2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", default=None, help="default: cuda,triton on a GPU; cpp,triton on a CPU")
    p.add_argument(
        "--out", default=os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None
    )
    p.add_argument("--no-timing", action="store_true")
    args = p.parse_args(argv)
    device = args.device
    small = device != "cuda"
    backends = (args.backends or ("cuda,triton" if device == "cuda" else "cpp,triton")).split(",")
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    print(f"gpu_check on {info['device']} (torch {torch.__version__})")

    from palestra.kernels.build import CPU_LIBRARY, CUDA_LIBRARY, KernelBuildError

    builds = {}
    for lib in (CPU_LIBRARY, CUDA_LIBRARY) if device == "cuda" else (CPU_LIBRARY,):
        t0 = time.perf_counter()
        try:
            lib.load()
            builds[lib.name] = f"ok in {time.perf_counter() - t0:.1f}s"
        except KernelBuildError as e:
            builds[lib.name] = f"FAILED: {e}"
        print(f"  build {lib.name}: {builds[lib.name]}")

    failures: dict[str, list[str]] = {}
    for backend in backends:
        print(f"  checking the {backend} back end against float64 references")
        failures[backend] = check_backend(backend, device, small)

    rows = []
    bw = None
    if not args.no_timing:
        bw = copy_bandwidth(device)
        print(f"  measured copy bandwidth: {bw / 1e9:.1f} GB/s")
        from palestra.cli.bench import load_cases

        for case in load_cases(HERE, device, quick=small, ops=set()):
            if not case.get("baseline") and case["impl"] not in backends:
                continue  # e.g. the cpp rows on a GPU run
            try:
                seconds = timed(case["fn"], device)
            except Exception as e:  # noqa: BLE001 - a case that fails is reported, and the others still run
                print(f"    {case['op']:<22} {case['size']:<22} {case['impl']:<16} failed: {type(e).__name__}: {e}")
                continue
            gbps = case.get("bytes", 0) / seconds / 1e9 if case.get("bytes") else math.nan
            frac = (case.get("bytes", 0) / seconds) / bw if case.get("bytes") else math.nan
            rows.append(
                {**{k: case[k] for k in ("op", "size", "impl")}, "seconds": seconds, "gbps": gbps, "of_copy_bw": frac}
            )
            print(
                f"    {case['op']:<22} {case['size']:<22} {case['impl']:<16} {seconds * 1e3:9.3f} ms "
                f"{gbps:8.1f} GB/s {frac * 100:6.1f}% of copy"
            )

    bad = sum(len(f) for f in failures.values()) + sum(1 for b in builds.values() if b.startswith("FAILED"))
    print(f"gpu_check: {bad} failure(s)" + "".join(f"\n  {b}: {', '.join(f)}" for b, f in failures.items() if f))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {"info": info, "builds": builds, "failures": failures, "copy_bw": bw, "rows": rows},
                indent=2,
                default=str,
            )
        )
        print(f"  written to {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
