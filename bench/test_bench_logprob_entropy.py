"""pytest-benchmark suite for the fused log-prob gather with entropy: our back ends vs one read pass
(``logits.sum(-1)``), eager torch and TRL's helpers, all measured in the same run.

    pytest bench/test_bench_logprob_entropy.py -s          # CPU: 4096 x 32768 fp32 (2-3 minutes on 2 cores)
    pytest bench/test_bench_logprob_entropy.py -s -k targets   # only the summary of the ratios below

Each of our rows records, in ``extra_info``, its speed-up over every baseline of its group (median
times of the same run). ``test_targets`` (run first) prints the ratios the CPU kernel is designed for,
each pair timed alternately so that both sides see the same load on a shared machine:

* forward time / ``logits.sum(-1)`` time (design target: at most 3);
* TRL (``selective_log_softmax`` + ``entropy_from_logits``) forward time / ours (at least 30);
* eager torch forward + backward time / ours (at least 8), and our extra peak memory beyond the
  gradient itself (O(N)).

Speed is reported, never asserted.

Memory regime: while this module runs, glibc serves every allocation of 1 MiB or more with a fresh
mmap (``mallopt(M_MMAP_THRESHOLD / M_TRIM_THRESHOLD, 1 MiB)``), so every implementation pays for
first-touching its outputs and temporaries on every call, as it would without a caching allocator.
Without this, which implementation happens to reuse memory freed by an earlier row depends on the order
the rows run in. (On this VM a fresh 512 MiB buffer in 4 KiB pages costs ~0.25 s of page faults; our
backward advises its gradient as huge pages: 93-120 ms for our forward + backward, 310 ms with THP off.)
"""

from __future__ import annotations

import ctypes
import statistics

import pytest
import torch

import cases_logprob_entropy as C
from timing import DEVICE
from timing import timed as _timed

CASES = [pytest.param(c, id=f"{c['op']}-{c['size']}-{c['impl']}") for c in C.cases(DEVICE, quick=False)]
ALL = [p.values[0] for p in CASES]
_MEDIANS: dict[tuple[str, str, str], float] = {}


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_GLIBC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_THRESHOLD: 128 * 1024}


@pytest.fixture(scope="module", autouse=True)
def fresh_pages_for_large_allocations():
    """See the module docstring; a no-op where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        yield
        return
    for param in _GLIBC_DEFAULTS:
        mallopt(param, 1 << 20)
    try:
        yield
    finally:
        for param, value in _GLIBC_DEFAULTS.items():
            mallopt(param, value)


def median_seconds(case: dict) -> float:
    """Median of a few timed calls after one warm-up (which also builds the native library); cached so
    that every ratio of the session divides the same measurements. Slow rows get fewer calls: past 5 s
    (TRL's fwd + bwd takes 15-40 s here) the warm-up call is the measurement."""
    key = (case["op"], case["size"], case["impl"])
    if key not in _MEDIANS:
        first = _timed(case["fn"])
        calls = 0 if first > 5.0 else 3 if first > 0.5 else 7
        _MEDIANS[key] = statistics.median([_timed(case["fn"]) for _ in range(calls)] or [first])
    return _MEDIANS[key]


def paired_medians(ours: dict, base: dict, rounds: int) -> tuple[float, float]:
    """Medians of ``ours`` and ``base`` timed alternately (base, ours, ours, ...), so that both see the
    same load on a shared machine; they also fill the cache used by test_bench."""
    _timed(ours["fn"])
    _timed(base["fn"])
    mine, theirs = [], []
    for _ in range(rounds):
        theirs.append(_timed(base["fn"]))
        mine += [_timed(ours["fn"]), _timed(ours["fn"])]
    for case, times in ((ours, mine), (base, theirs)):
        _MEDIANS.setdefault((case["op"], case["size"], case["impl"]), statistics.median(times))
    return statistics.median(mine), statistics.median(theirs)


def _find(op: str, impl: str) -> dict | None:
    return next((c for c in ALL if c["op"] == op and c["impl"] == impl), None)


def _median_or_skip(case: dict) -> float:
    try:
        return median_seconds(case)
    except ImportError as e:  # TRL is an optional peer
        pytest.skip(f"{case['impl']} baseline unavailable: {e}")


@pytest.mark.skipif(DEVICE != "cpu", reason="the ratio targets are for the CPU kernel")
def test_targets(benchmark):
    """The design targets' ratios, each from alternated timings of the pair (printed; in extra_info)."""
    benchmark.group = "logprob_entropy targets (cpu)"
    fwd, fwd_bwd = _find(C.OP_FWD, "cpp"), _find(C.OP_FWD_BWD, "cpp")
    rows = []  # (name, ours seconds, baseline seconds, ratio)
    ours_s, sum_s = paired_medians(fwd, _find(C.OP_FWD, "sum"), rounds=7)
    rows.append(("fwd / logits.sum(-1)   (target <= 3)", ours_s, sum_s, ours_s / sum_s))
    try:
        ours_s, trl_s = paired_medians(fwd, _find(C.OP_FWD, "trl"), rounds=2)
        rows.append(("TRL fwd / ours         (target >= 30)", ours_s, trl_s, trl_s / ours_s))
    except ImportError as e:
        print(f"\nTRL baseline unavailable: {e}")
    ours_s, eager_s = paired_medians(fwd_bwd, _find(C.OP_FWD_BWD, "torch-eager"), rounds=3)
    rows.append(("eager fwd+bwd / ours   (target >= 8)", ours_s, eager_s, eager_s / ours_s))
    grad_bytes = fwd_bwd["bytes"] / 3
    peak = _peak_extra_bytes(fwd_bwd["fn"])
    lines = [f"\nlogprob_entropy on {fwd['size']}, {torch.get_num_threads()} threads (medians):"]
    for name, ours_s, base_s, ratio in rows:
        benchmark.extra_info[name.split("(")[0].strip()] = round(ratio, 2)
        lines.append(f"  {name}  {ratio:8.2f}   (ours {ours_s * 1e3:.1f} ms, baseline {base_s * 1e3:.1f} ms)")
    if peak is not None:
        benchmark.extra_info["fwd+bwd peak bytes beyond the gradient"] = peak - grad_bytes
        lines.append(
            f"  fwd+bwd peak memory beyond the [N, V] gradient: {(peak - grad_bytes) / 2**20:.1f} MiB "
            f"(the gradient itself is {grad_bytes / 2**20:.0f} MiB)"
        )
    print("\n".join(lines))
    benchmark.pedantic(fwd["fn"], rounds=3, iterations=1)


@pytest.mark.parametrize("case", CASES)
def test_bench(benchmark, case):
    benchmark.group = f"{case['op']} {case['size']} ({DEVICE})"
    ours = _median_or_skip(case)
    benchmark.extra_info["median_s"] = ours
    benchmark.extra_info["GB/s"] = round(case["bytes"] / ours / 1e9, 1)
    if not case["baseline"]:
        for base in ALL:
            if base["baseline"] and base["op"] == case["op"] and base["size"] == case["size"]:
                try:
                    benchmark.extra_info[f"speedup_vs_{base['impl']}"] = round(median_seconds(base) / ours, 2)
                except ImportError:
                    continue
    rounds = 1 if ours > 5.0 else 2 if ours > 0.5 else 5
    benchmark.pedantic(case["fn"], rounds=rounds, iterations=1, warmup_rounds=0)


def _peak_extra_bytes(fn) -> float | None:
    """Peak resident memory added by one call (Linux: VmHWM after resetting it), None elsewhere."""
    try:
        from palestra.cli.bench import peak_memory
    except ImportError:
        return None
    return peak_memory(fn, DEVICE)


def test_baselines_agree_with_ours():
    """The baselines compute what we compute, so the ratios compare like with like."""
    logits, tokens, g_logp, g_ent = C.inputs(8, 1000, torch.float32, DEVICE, seed=1)
    tokens[3] = -100
    ours = C.ours(None)(logits, tokens)
    impls = [C.torch_eager]
    try:
        C.trl(logits[:1], tokens[:1])
        impls.append(C.trl)
    except ImportError:
        pass
    for impl in impls:
        torch.testing.assert_close(impl(logits, tokens), ours, rtol=1e-4, atol=1e-4)
        grads = [C.fwd_bwd_fn(f, logits, tokens, g_logp, g_ent)() for f in (impl, C.ours(None))]
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
