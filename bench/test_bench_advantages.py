"""pytest-benchmark suite for the advantage estimators: our native back ends vs our own torch back end (the
reference ``auto`` is held to, timed through the same public call and wrapper), and the peers torchrl's
vectorised GAE, a verl-style loop over time and TRL-style eager torch, all measured in the same run.

    pytest bench/test_bench_advantages.py                      # default sizes (a few minutes at most on 2 cores)
    pytest bench/test_bench_advantages.py -m slow              # the big sizes only
    pytest bench/test_bench_advantages.py -k "gae and B=256"   # the 2-core target: gae at B=256, T=1024

Each native row records, in ``extra_info``, its speed-up over every baseline of its group (the torch row
and the peers; median times of the same run); speed is reported, never asserted. For figures to record, time
the back ends alternately: ``OMP_NUM_THREADS=1 python bench/cases_advantages.py --update FILE.json``.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import cases_advantages as C
import palestra.kernels as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

try:
    import pytest_benchmark  # noqa: F401  (its plugin provides the ``benchmark`` fixture)
except ImportError:  # without it the timed rows skip; the agreement checks below still run

    @pytest.fixture
    def benchmark():
        pytest.skip("pytest-benchmark is not installed (pip install -e '.[bench]')")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, min_time: float = 0.3, max_calls: int = 50) -> float:
    fn()
    _sync()
    times: list[float] = []
    while len(times) < 3 or (sum(times) < min_time and len(times) < max_calls):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _param(case: dict, *marks):
    return pytest.param(case, id=f"{case['op']}-{case['size']}-{case['impl']}", marks=marks)


# Default sizes, then the big ones (CPU: gae at B=1024, T=4096; groups of 64 over 64k rewards) under -m slow.
CASES = [_param(c) for c in C.cases(DEVICE, quick=False)] + [
    _param(c, pytest.mark.slow) for c in C.cases(DEVICE, quick=False, big=True)
]
ALL = [p.values[0] for p in CASES]


def _baselines_of(case: dict) -> list[dict]:
    return [c for c in ALL if c["baseline"] and c["op"] == case["op"] and c["size"] == case["size"]]


def _run_or_skip(fn):
    try:
        return fn()
    except ImportError as e:  # an optional peer (torchrl) that is not installed
        pytest.skip(str(e))


@pytest.mark.parametrize("case", CASES)
def test_bench(benchmark, case):
    benchmark.group = f"{case['op']} {case['size']} ({DEVICE})"
    _run_or_skip(case["fn"])
    if not case["baseline"]:
        ours = median_seconds(case["fn"])
        benchmark.extra_info["median_s"] = ours
        for base in _baselines_of(case):
            try:
                t = median_seconds(base["fn"], min_time=0.5, max_calls=10)
            except ImportError:
                continue
            benchmark.extra_info[f"speedup_vs_{base['impl']}"] = round(t / ours, 2)
        print(
            f"\n{case['op']} {case['size']} {case['impl']}: {ours * 1e3:.3f} ms; "
            + ", ".join(
                f"{k.removeprefix('speedup_vs_')} x{v}"
                for k, v in benchmark.extra_info.items()
                if k.startswith("speedup")
            )
        )
    benchmark(case["fn"])


# ---- the baselines compute what we compute (at valid positions), so the ratios compare like with like ----
def test_baselines_agree_with_ours():
    r, v, m = C.sequences(16, 200, DEVICE, seed=3)
    adv, ret = K.gae(r, v, m, C.GAMMA, C.LAM)
    verl_adv, verl_ret = C.verl_style_gae(r, v, m, C.GAMMA, C.LAM)
    torch.testing.assert_close(adv[m], verl_adv[m], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ret[m], verl_ret[m], rtol=1e-4, atol=1e-4)
    try:
        rl_adv, _ = C.torchrl_gae()(C.GAMMA, C.LAM, *C.torchrl_inputs(r, v, m))
        torch.testing.assert_close(adv[m], rl_adv.squeeze(-1)[m], rtol=1e-4, atol=1e-4)
    except ImportError:
        pass
    torch.testing.assert_close(
        K.discounted_returns(r, m, C.GAMMA), C.verl_style_returns(r, m, C.GAMMA), rtol=1e-4, atol=1e-4
    )
    x = torch.randn(64, device=DEVICE)
    for scale in ("group", "batch", "none"):
        torch.testing.assert_close(
            K.group_advantages(x, 8, scale=scale), C.eager_group(x, 8, scale), rtol=1e-5, atol=1e-5
        )
    torch.testing.assert_close(K.rloo_advantages(x, 8), C.eager_rloo(x, 8), rtol=1e-5, atol=1e-5)


def test_every_row_of_ours_runs_the_back_end_it_names():
    """The ``torch`` row really runs the torch back end (and ``cpp`` the cpp one), the wrapper leaves
    nothing forced behind it, and every implementation of a group computes the same thing."""
    from palestra.kernels import dispatch

    before = dispatch._forced
    group_ops = ("group_advantages[group]", "group_advantages[none]", "rloo_advantages")
    cases = [c for c in C.cases(DEVICE, quick=True) if c["op"] in group_ops]
    for case in cases:
        same = [c for c in cases if c["op"] == case["op"] and c["size"] == case["size"]]
        torch.testing.assert_close(case["fn"](), same[-1]["fn"](), rtol=1e-5, atol=1e-5)  # the eager peer
        if case["baseline"] and case["impl"] != "torch":
            continue
        op = dispatch._OPS["group_advantages" if case["op"] == "group_advantages[group]" else case["op"]]
        ran = []
        saved = dict(op.impls)
        try:
            for backend, fn in saved.items():
                op.impls[backend] = lambda *a, _b=backend, _f=fn, _ran=ran, **k: (_ran.append(_b), _f(*a, **k))[1]
            case["fn"]()
        finally:
            op.impls.update(saved)
        assert ran == [case["impl"]], (case["op"], case["impl"], ran)
        assert dispatch._forced == before
