"""``auto`` never picks a back end that the project's own CPU benchmark shows slower than the reference,
Palestra's own torch back end.

The recorded runs are ``bench/results/cpu*.json`` (``palestra bench --out``, some ops re-measured since by
``python bench/cases_advantages.py --update``, see ``meta.remeasured``; ``cpu.txt`` / ``cpu-run2.txt`` are the
same runs as tables). Each row is one (op, size, impl) with its median time in ``seconds``. ``impl`` is a back
end's name for our rows (``cpp`` on a CPU, and ``torch``: the same public call forced to the torch back end,
timed through the same wrapper); the other rows are peers measured in the same run (TRL-style eager torch, TRL,
torchrl, a verl-style loop).

The rule is against the ``torch`` row at the same size in the same run. The peers are reported in the
failure message, not the rule: a native back end faster than our torch reference but slower than a bare
float32 peer is still the better choice for ``auto`` (the peer is not one of its options). A run with no
``torch`` row for an op (ops not re-measured since the torch rows were added) has only its peers to go by;
they stand in for the reference there.

Which back end ``auto`` uses is observed, not recomputed: every op's implementations are wrapped with a
recorder and the public function is called the way the benchmark calls it (same op, same options, a small
input). So the test checks what a user gets, whatever the dispatch code looks like.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import palestra.kernels as K
from palestra.kernels import dispatch

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
RUNS = sorted(RESULTS.glob("cpu*.json"))
CPU = torch.device("cpu")

# Baseline rows that are not an implementation of the op, so not a reference to beat: ``sum`` is
# ``logits.sum(-1)``, the floor of one read pass (bench/cases_logprob_entropy.py).
NOT_A_REFERENCE = {"sum"}


def _rows(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    assert data["meta"]["device"] and not data["meta"].get("quick"), f"{path.name}: not a full CPU run"
    return data["rows"]


def _bench_ops() -> list[str]:
    return sorted({row["op"] for path in RUNS for row in _rows(path)})


# ---- one call per benchmarked op, with the options the benchmark uses (bench/cases_*.py) -------------
def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sequences():
    g = _gen()
    mask = torch.arange(32)[None, :] < torch.randint(16, 33, (4,), generator=g)[:, None]
    return torch.randn(4, 32, generator=g) * mask, torch.randn(4, 32, generator=g), mask


def _logprob_fwd_bwd():
    logits = torch.randn(8, 64, generator=_gen()).requires_grad_()
    tokens = torch.randint(0, 64, (8,), generator=_gen(1))
    logp, entropy = K.logprob_entropy(logits, tokens)
    return torch.autograd.grad((logp.sum() + entropy.sum()), logits)


def _normalize():
    rewards = torch.randn(256, generator=_gen())
    K.normalize_rewards(rewards, K.RunningMoments())
    segments = torch.randint(0, 8, (256,), generator=_gen(1))
    return K.normalize_rewards(rewards, K.RunningMoments(num_segments=8), segment_ids=segments)


_REWARDS = lambda: torch.randn(128, generator=_gen())  # noqa: E731

CALLS = {
    "gae": lambda: K.gae(*_sequences(), 0.99, 0.95),
    "discounted_returns": lambda: K.discounted_returns(_sequences()[0], _sequences()[2], 0.99),
    "group_advantages[group]": lambda: K.group_advantages(_REWARDS(), 16, scale="group"),
    "group_advantages[none]": lambda: K.group_advantages(_REWARDS(), 16, scale="none"),
    "rloo_advantages": lambda: K.rloo_advantages(_REWARDS(), 16),
    "logprob_entropy": lambda: K.logprob_entropy(torch.randn(8, 64, generator=_gen()), torch.randint(0, 64, (8,))),
    "logprob_entropy_fwd_bwd": _logprob_fwd_bwd,
    "normalize_rewards": _normalize,
}


@pytest.fixture
def automatic(monkeypatch):
    """Nothing forced: neither ``set_backend`` nor ``PALESTRA_KERNELS``."""
    previous = dispatch._forced
    monkeypatch.delenv("PALESTRA_KERNELS", raising=False)
    dispatch.set_backend(None)
    yield
    dispatch.set_backend(previous)


def backends_used(call, monkeypatch) -> set[str]:
    """The back ends whose implementations ran during ``call()``."""
    used: set[str] = set()
    for op in dispatch._OPS.values():
        for backend, fn in list(op.impls.items()):

            def recorder(*args, _fn=fn, _backend=backend, **kwargs):
                used.add(_backend)
                return _fn(*args, **kwargs)

            monkeypatch.setitem(op.impls, backend, recorder)
    call()
    assert used, "no back end ran: the call does not go through dispatch"
    return used


# ---------------------------------------------------------------------------------------------------
# (1) every back end auto picks on the CPU is faster than the torch reference, in every recorded run
# ---------------------------------------------------------------------------------------------------
REFERENCE = "torch"
# Ops whose recorded runs must have a torch row: those re-measured with it (bench/cases_advantages.py).
TORCH_TIMED = {"group_advantages[group]", "group_advantages[none]", "rloo_advantages"}


def _ms(row: dict) -> str:
    return f"{row['impl']} {row['seconds'] * 1e3:.4f} ms"


def compare_with_reference(op: str, backend: str, runs: dict[str, list[dict]]) -> tuple[list[str], list[str]]:
    """(where ``backend`` is not faster than the reference, the peers' figures) for ``op`` in ``runs``
    (run name -> rows). The reference is the ``torch`` row of the same run and size; where a run has none,
    every peer (a baseline row other than a floor such as ``sum``) stands in for it."""
    slower, peers = [], []
    for name, all_rows in runs.items():
        rows = [row for row in all_rows if row["op"] == op]
        for size in sorted({row["size"] for row in rows}):
            at_size = {row["impl"]: row for row in rows if row["size"] == size}
            ours = at_size.get(backend)
            assert ours is not None and ours["error"] is None and ours["seconds"] > 0, (
                f"auto picks {backend} for {op} on the CPU, but {name} has no timing of it at {size}"
            )
            others = [
                row
                for impl, row in at_size.items()
                if impl not in (backend, REFERENCE)
                and row["baseline"]
                and row["error"] is None
                and impl not in NOT_A_REFERENCE
            ]
            reference = at_size.get(REFERENCE)
            if reference is not None:
                assert reference["error"] is None, f"{name}: the torch reference failed for {op} at {size}"
                references = [reference]
                peers += [
                    f"{name} {size}: {_ms(ours)} vs peer {_ms(p)} ({p['seconds'] / ours['seconds']:.2f}x)"
                    for p in others
                ]
            else:
                references = others
            assert references, f"{name}: {op} at {size} has no reference timing to compare with"
            slower += [
                f"{name} {size}: {_ms(ours)} vs {_ms(ref)} ({ref['seconds'] / ours['seconds']:.2f}x)"
                for ref in references
                if not ours["seconds"] < ref["seconds"]
            ]
    return slower, peers


def _runs() -> dict[str, list[dict]]:
    return {path.name: _rows(path) for path in RUNS}


def test_the_benchmark_results_are_there():
    assert {"cpu.json", "cpu-run2.json"} <= {p.name for p in RUNS}, RUNS
    assert set(_bench_ops()) == set(CALLS), "a benchmarked op without a call here (or the reverse): add it to CALLS"


def test_the_torch_reference_is_timed_in_every_run():
    """The group ops were re-measured with the torch row; any op timed against torch in one run is in all."""
    runs = _runs()
    timed = {row["op"] for rows in runs.values() for row in rows if row["impl"] == REFERENCE}
    assert timed >= TORCH_TIMED, f"no torch row for {sorted(TORCH_TIMED - timed)}"
    for name, rows in runs.items():
        for op in timed:
            sizes = {row["size"] for row in rows if row["op"] == op}
            with_torch = {row["size"] for row in rows if row["op"] == op and row["impl"] == REFERENCE}
            assert sizes == with_torch, f"{name}: {op} has no torch row at {sorted(sizes - with_torch)}"


@pytest.mark.parametrize("op", _bench_ops())
def test_auto_never_picks_a_back_end_the_benchmark_shows_slower_than_torch(op, automatic, monkeypatch):
    used = backends_used(CALLS[op], monkeypatch)
    assert len(used) == 1, f"{op}: several back ends ran through auto: {sorted(used)}"
    (backend,) = used
    if backend == REFERENCE:
        return  # the reference itself
    slower, peers = compare_with_reference(op, backend, _runs())
    assert not slower, (
        f"auto picks {backend} for {op} on the CPU, which the benchmark shows slower than the reference: "
        + "; ".join(slower)
        + (" (peers, not the rule: " + "; ".join(peers) + ")" if peers else "")
    )


@pytest.mark.parametrize("op", sorted(TORCH_TIMED))
def test_auto_uses_cpp_where_every_run_shows_it_faster_than_torch(op, automatic, monkeypatch):
    """The other direction: the table does not keep ``auto`` on the reference where cpp beats it."""
    slower, _ = compare_with_reference(op, "cpp", _runs())
    if slower:
        pytest.skip(f"cpp is not faster than torch for {op} in every run: " + "; ".join(slower))
    assert backends_used(CALLS[op], monkeypatch) == {"cpp"}, f"auto leaves {op} on torch, which cpp beats"


def _row(impl: str, us: float, baseline: bool, op: str = "rloo_advantages", size: str = "B=8 group=4") -> dict:
    return dict(op=op, size=size, impl=impl, baseline=baseline, seconds=us * 1e-6, error=None)


def test_the_check_fails_on_a_back_end_slower_than_torch_and_follows_torch_not_the_peer():
    # cpp slower than torch (though faster than the peer): flagged
    slower, _ = compare_with_reference(
        "rloo_advantages",
        "cpp",
        {"a.json": [_row("cpp", 30, False), _row("torch", 25, True), _row("torch-eager", 40, True)]},
    )
    assert len(slower) == 1 and "cpp 0.0300 ms vs torch 0.0250 ms" in slower[0], slower
    # slower than torch in one run of two: flagged
    slower, _ = compare_with_reference(
        "rloo_advantages",
        "cpp",
        {
            "a.json": [_row("cpp", 8, False), _row("torch", 25, True)],
            "b.json": [_row("cpp", 26, False), _row("torch", 25, True)],
        },
    )
    assert len(slower) == 1 and slower[0].startswith("b.json"), slower
    # faster than torch, slower than the bare peer: allowed, the peer only reported
    slower, peers = compare_with_reference(
        "rloo_advantages",
        "cpp",
        {"a.json": [_row("cpp", 10, False), _row("torch", 20, True), _row("torch-eager", 9, True)]},
    )
    assert slower == [] and len(peers) == 1 and "peer torch-eager" in peers[0], (slower, peers)
    # no torch row in a run: the peers stand in
    slower, _ = compare_with_reference(
        "gae",
        "cpp",
        {"a.json": [_row("cpp", 10, False, "gae"), _row("verl-loop", 9, True, "gae"), _row("sum", 5, True, "gae")]},
    )
    assert len(slower) == 1 and "verl-loop" in slower[0], slower
    # a back end auto picks that the run never timed: an error, not a pass
    with pytest.raises(AssertionError, match="has no timing of it"):
        compare_with_reference("rloo_advantages", "cpp", {"a.json": [_row("torch", 25, True)]})


def test_the_table_names_real_ops_and_always_keeps_the_torch_reference():
    for (op, device_type), allowed in dispatch.AUTO_BACKENDS.items():
        assert op in dispatch._OPS, f"AUTO_BACKENDS names {op!r}, which is no op (known: {sorted(dispatch._OPS)})"
        assert device_type in dispatch.AUTO_ORDER, (op, device_type)
        assert "torch" in allowed and set(allowed) <= set(dispatch.BACKENDS), (op, device_type, allowed)
        assert dispatch.auto_order(op, device_type)[-1] == "torch"


# ---------------------------------------------------------------------------------------------------
# (2) the results through auto are the reference's, and what auto gave before (the cpp kernels) to fp32 rounding
# ---------------------------------------------------------------------------------------------------
def _through(backend: str | None, fn):
    previous = dispatch._forced
    dispatch.set_backend(backend)
    try:
        return fn()
    finally:
        dispatch.set_backend(previous)


GROUP_CASES = [
    pytest.param(lambda x, k: K.group_advantages(x, k, scale="none"), id="group_advantages[none]"),
    pytest.param(lambda x, k: K.group_advantages(x, k, scale="group"), id="group_advantages[group]"),
    pytest.param(lambda x, k: K.group_advantages(x, k, scale="batch"), id="group_advantages[batch]"),
    pytest.param(lambda x, k: K.rloo_advantages(x, k), id="rloo_advantages"),
]


@pytest.mark.parametrize("fn", GROUP_CASES)
@pytest.mark.parametrize("B,k", [(8192, 16), (96, 3), (64, 64)])
def test_results_through_auto_match_the_torch_reference_and_the_cpp_kernels(fn, B, k, automatic):
    x = torch.randn(B, generator=_gen(B + k)) * 3 + 1
    by_auto = fn(x, k)
    by_torch = _through("torch", lambda: fn(x, k))
    by_cpp = _through("cpp", lambda: fn(x, k))
    assert by_auto.dtype == torch.float32 and by_auto.shape == x.shape
    torch.testing.assert_close(by_auto, by_torch)
    torch.testing.assert_close(by_auto, by_cpp)
    # bit for bit the back end auto resolved to
    assert torch.equal(by_auto, by_torch) or torch.equal(by_auto, by_cpp)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("op", sorted(TORCH_TIMED))
def test_forcing_a_back_end_runs_it_whatever_auto_prefers(op, backend, automatic, monkeypatch):
    monkeypatch.setenv("PALESTRA_KERNELS", backend)
    assert backends_used(CALLS[op], monkeypatch) == {backend}, op
