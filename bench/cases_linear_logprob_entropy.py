"""Benchmark cases for the output head fused with the log-prob kernel (used by ``palestra bench`` and
bench/gpu_check.py), and, run as a script, the fused-vs-unfused comparison of time and memory.

``cases(device, quick)`` returns one dict per (op, size, implementation); ``fn`` runs one call. Two ops:

* ``linear_logprob_entropy``: the forward pass without autograd (scoring rollouts);
* ``linear_logprob_entropy_fwd_bwd``: forward, then the gradients of ``sum(g1 * logp + g2 * entropy)`` with
  respect to the hidden states and the head's weight (``torch.autograd.grad``).

Ours is :func:`palestra.kernels.linear_logprob_entropy` on the device's native back end. Baselines, measured in
the same run:

* ``unfused``: ``F.linear`` then :func:`palestra.kernels.logprob_entropy`, what ``CausalLMPolicy.score`` runs for
  a head it cannot fuse: the ``[N, V]`` logits are kept for the backward pass;
* ``torch-eager``: ``F.linear``, ``log_softmax``, ``gather``, ``-(p * log p).sum(-1)``, all kept by autograd.

Sizes: N = 4096 tokens through SmolLM2-135M's head (H = 576, V = 49152) and a small one (N = 512, H = 64,
V = 8192); fp32 on a CPU, bf16 on a GPU. ``--quick``: the small one only.

As a script, the three implementations run in turn (alternated, so a busy shared machine loads each the same)
at each size, forward + backward, and it prints the median time, the bytes autograd saves beyond the inputs
(``torch.autograd.graph.saved_tensors_hooks``) and the peak memory of one call beyond what was allocated before
it (CUDA: ``max_memory_allocated``; Linux CPU: the resident set's high-water mark, as ``palestra bench``, with
glibc told to serve every allocation of 1 MiB or more from fresh pages, as bench/test_bench_logprob_entropy.py
does, so that memory an earlier call freed does not hide a peak)::

    OMP_NUM_THREADS=1 python bench/cases_linear_logprob_entropy.py [--rounds 3] [--small-only] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import palestra.kernels as K

OP_FWD = "linear_logprob_entropy"
OP_FWD_BWD = "linear_logprob_entropy_fwd_bwd"
SMOLLM2 = (4096, 576, 49152)  # tokens, SmolLM2-135M's hidden size and vocabulary
SMALL = (512, 64, 8192)


def sizes(device: str, quick: bool) -> list[tuple[int, int, int, torch.dtype]]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = [SMALL] if quick else [SMALL, SMOLLM2]
    return [(n, h, v, dtype) for n, h, v in shapes]


def inputs(n_rows: int, hidden_size: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Hidden states of unit scale and a head scaled to logits of spread ~2 (a trained LM head's), targets (none
    ignored), and random upstream gradients for both outputs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n_rows, hidden_size, generator=gen, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, device=device) * (2.0 / hidden_size**0.5)).to(dtype)
    targets = torch.randint(0, vocab, (n_rows,), generator=gen, device=device)
    g_logp = torch.randn(n_rows, generator=gen, device=device)
    g_ent = torch.randn(n_rows, generator=gen, device=device)
    return hidden, weight, targets, g_logp, g_ent


# ---- the implementations, as (hidden, weight, targets) -> (logp, entropy) --------------------------------
def ours(backend: str) -> Callable:
    return lambda hidden, weight, targets: K.linear_logprob_entropy(hidden, weight, None, targets, backend=backend)


def unfused(hidden, weight, targets):
    return K.logprob_entropy(torch.nn.functional.linear(hidden, weight), targets)


def torch_eager(hidden, weight, targets):
    log_p = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), dim=-1)
    logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(log_p.exp() * log_p).sum(-1)


def forward_fn(impl: Callable, hidden, weight, targets) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return impl(hidden, weight, targets)

    return run


def fwd_bwd_fn(impl: Callable, hidden, weight, targets, g_logp, g_ent) -> Callable[[], object]:
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)

    def run():
        logp, entropy = impl(h, w, targets)
        return torch.autograd.grad((logp, entropy), (h, w), (g_logp, g_ent))

    return run


def implementations(device: str) -> list[tuple[str, Callable, bool]]:
    backends = ["cuda", "triton"] if device == "cuda" else ["cpp"]
    return [(b, ours(b), False) for b in backends] + [("unfused", unfused, True), ("torch-eager", torch_eager, True)]


def _size_name(n_rows, hidden_size, vocab, dtype) -> str:
    return f"{n_rows}x{hidden_size}x{vocab} {str(dtype).removeprefix('torch.')}"


def cases(device: str, quick: bool) -> list[dict]:
    out: list[dict] = []
    for n_rows, hidden_size, vocab, dtype in sizes(device, quick):
        hidden, weight, targets, g_logp, g_ent = inputs(n_rows, hidden_size, vocab, dtype, device)
        size = _size_name(n_rows, hidden_size, vocab, dtype)
        # at least: read the weight once (forward); three times, and write its gradient, forward + backward
        nbytes = weight.numel() * weight.element_size()
        for impl, fn, baseline in implementations(device):
            out.append(
                {
                    "op": OP_FWD,
                    "size": size,
                    "impl": impl,
                    "baseline": baseline,
                    "bytes": nbytes,
                    "fn": forward_fn(fn, hidden, weight, targets),
                }
            )
            out.append(
                {
                    "op": OP_FWD_BWD,
                    "size": size,
                    "impl": impl,
                    "baseline": baseline,
                    "bytes": 4 * nbytes,
                    "fn": fwd_bwd_fn(fn, hidden, weight, targets, g_logp, g_ent),
                }
            )
    return out


# ---- the script: alternated timing, saved bytes, peak memory ------------------------------------------
def saved_bytes(impl: Callable, hidden, weight, targets) -> int:
    """Bytes autograd saves for the backward pass beyond the inputs' own storages (counted once each)."""
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    inputs_ = {t.untyped_storage().data_ptr() for t in (h, w, targets)}
    extra: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs_:
            extra[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = impl(h, w, targets)
    del outs
    return sum(extra.values())


def _mib(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


def fresh_pages_for_large_allocations() -> None:
    """glibc: allocations of 1 MiB or more get their own mmap and go back to the system when freed (see the module
    docstring); nothing elsewhere."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    for param in (-1, -3):  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
        mallopt(param, 1 << 20)


def measure(device: str, shapes, rounds: int) -> list[dict]:
    from palestra.cli.bench import peak_memory

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    rows = []
    for n_rows, hidden_size, vocab, dtype in shapes:
        size = _size_name(n_rows, hidden_size, vocab, dtype)
        hidden, weight, targets, g_logp, g_ent = inputs(n_rows, hidden_size, vocab, dtype, device)
        impls = implementations(device)
        fns = {name: fwd_bwd_fn(fn, hidden, weight, targets, g_logp, g_ent) for name, fn, _ in impls}
        for fn in fns.values():  # warm-up (and the native build)
            fn()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():  # alternated: each round runs every implementation once
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
        for name, fn, _ in impls:
            row = {
                "size": size,
                "impl": name,
                "seconds": statistics.median(times[name]),
                "times": times[name],
                "saved_bytes": saved_bytes(fn, hidden, weight, targets),
                "peak_bytes": peak_memory(fns[name], device),
            }
            rows.append(row)
            print(
                f"  {size:<24} {name:<12} {row['seconds'] * 1e3:10.1f} ms   saved {_mib(row['saved_bytes']):>12}"
                f"   peak {_mib(row['peak_bytes']):>12}",
                flush=True,
            )
        ours_rows = [r for r in rows if r["size"] == size and r["impl"] in ("cpp", "cuda", "triton")]
        for base in ("unfused", "torch-eager"):
            b = next(r for r in rows if r["size"] == size and r["impl"] == base)
            for r in ours_rows:
                peak = (
                    f", peak {b['peak_bytes'] / max(r['peak_bytes'], 1):.2f}x lower"
                    if r["peak_bytes"] is not None and b["peak_bytes"] is not None
                    else ""
                )
                print(
                    f"  {size:<24} {r['impl']} vs {base}: time x{b['seconds'] / r['seconds']:.2f} (>1: ours faster)"
                    f"{peak}"
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=3, help="alternated timed calls per implementation")
    p.add_argument("--small-only", action="store_true", help=f"only the small shape {SMALL}")
    p.add_argument("--out", help="write the rows as JSON")
    args = p.parse_args(argv)
    shapes = sizes(args.device, quick=args.small_only)
    if args.device == "cpu":
        fresh_pages_for_large_allocations()
    print(
        f"linear_logprob_entropy fwd+bwd on {args.device}, torch threads {torch.get_num_threads()}, "
        f"{args.rounds} alternated rounds"
    )
    rows = measure(args.device, shapes, args.rounds)
    if args.out:
        meta = {
            "device": args.device,
            "threads": torch.get_num_threads(),
            "rounds": args.rounds,
            "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__,
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
