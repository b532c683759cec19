"""pytest-benchmark suite for normalize_rewards: our back ends vs the eager baselines of
bench/cases_reward_norm.py (straightforward eager torch; a TRL/OpenRLHF-style tracker), in the same run.

    pytest bench/test_bench_reward_norm.py -s                 # default sizes (64K, 1M), well under 3 min on 2 cores
    pytest bench/test_bench_reward_norm.py -s -k "1M"         # the 2-core target: 1M rewards, S=1 and S=8
    pytest bench/test_bench_reward_norm.py -s -m slow         # 16M rewards

Each of our rows records, in ``extra_info``, its speed-up over every baseline of its group, from calls of the
two interleaved (ours, baseline, ours, ...) so that load from other processes hits both alike; with ``-s``
the ratios are printed too. Speed is reported, never asserted.
"""

from __future__ import annotations

import statistics

import pytest
import torch

import cases_reward_norm as C
from timing import DEVICE
from timing import sync as _sync
from timing import timed as _timed


def interleaved(ours, baseline, min_time: float = 1.0, max_rounds: int = 60) -> tuple[list[float], list[float]]:
    """Times of ``ours`` and ``baseline`` called alternately (after a warm-up call of each)."""
    ours()
    baseline()
    _sync()
    a: list[float] = []
    b: list[float] = []
    while len(a) < 5 or (sum(a) + sum(b) < min_time and len(a) < max_rounds):
        a.append(_timed(ours))
        b.append(_timed(baseline))
    return a, b


def _big_cases() -> list[dict]:
    """16M rewards, for ``-m slow``."""
    saved = C.SIZES.copy()
    try:
        C.SIZES["64K"] = C.SIZES["16M"]  # reuse the quick list's one size slot for the big size
        rows = C.cases(DEVICE, quick=True)
    finally:
        C.SIZES.clear()
        C.SIZES.update(saved)
    for row in rows:
        row["size"] = row["size"].replace("64K", "16M")
    return rows


CASES = [pytest.param(c, id=f"{c['size']}-{c['impl']}".replace(" ", "-")) for c in C.cases(DEVICE, quick=False)] + [
    pytest.param(c, id=f"{c['size']}-{c['impl']}".replace(" ", "-"), marks=pytest.mark.slow) for c in _big_cases()
]
ALL = [p.values[0] for p in CASES]


def _baselines_of(case: dict) -> list[dict]:
    return [c for c in ALL if c["baseline"] and c["size"] == case["size"]]


@pytest.mark.parametrize("case", CASES)
def test_bench(benchmark, case):
    benchmark.group = f"{case['op']} {case['size']} ({DEVICE})"
    benchmark.extra_info.update(impl=case["impl"], bytes=case["bytes"], threads=torch.get_num_threads())
    if not case["baseline"]:
        for base in _baselines_of(case):
            a, b = interleaved(case["fn"], base["fn"])
            ratio_min, ratio_median = min(b) / min(a), statistics.median(b) / statistics.median(a)
            benchmark.extra_info[f"speedup_vs_{base['impl']}"] = round(ratio_min, 2)
            benchmark.extra_info[f"speedup_vs_{base['impl']}_median"] = round(ratio_median, 2)
            print(
                f"\n{case['op']} {case['size']}: {case['impl']} {min(a) * 1e3:.3f} ms vs {base['impl']} "
                f"{min(b) * 1e3:.3f} ms (best of {len(a)}): x{ratio_min:.2f} (medians: x{ratio_median:.2f})"
            )
    once = _timed(case["fn"])
    rounds = int(min(100, max(5, 0.5 / max(once, 1e-6))))
    benchmark.pedantic(case["fn"], rounds=rounds, iterations=1, warmup_rounds=1)
