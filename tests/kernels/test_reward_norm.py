"""normalize_rewards / RunningMoments: every back end against a float64 reference (numpy, written here).

The reference recomputes the statistics from the whole history of rewards with numpy's mean/var, so it shares
nothing with the kernels' block/merge algebra. Triton runs under TRITON_INTERPRET=1 (tests/conftest.py) on tiny
shapes only.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import zlib

import numpy as np
import pytest
import torch

from palestra import kernels as K
from palestra.kernels import reward_norm as RN
from palestra.kernels.build import CPU_LIBRARY, KernelBuildError
from palestra.kernels.dispatch import set_backend

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


# ---- helpers ---------------------------------------------------------------------------------------------
@pytest.fixture(params=["torch", "cpp", "triton"])
def backend(request):
    if request.param == "triton":
        pytest.importorskip("triton")
    set_backend(request.param)
    yield request.param
    set_backend(None)


@pytest.fixture
def cpp():
    set_backend("cpp")
    yield
    set_backend(None)


def rewards_like(rng: np.random.Generator, shape, dtype=torch.float32, loc=3.0, scale=2.0) -> torch.Tensor:
    return torch.from_numpy(rng.normal(loc, scale, size=shape)).to(dtype)


def segments(rng: np.random.Generator, shape, S: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, S, size=shape))


class Reference:
    """Float64 running statistics recomputed from the full history (numpy mean / population var)."""

    def __init__(self, S: int):
        self.S = S
        self.x: list[np.ndarray] = []
        self.s: list[np.ndarray] = []

    def add(self, rewards: torch.Tensor, seg: torch.Tensor | None) -> None:
        x = rewards.double().reshape(-1).numpy()
        self.x.append(x)
        self.s.append(np.zeros(x.shape, np.int64) if seg is None else seg.reshape(-1).numpy())

    def stats(self):
        x = np.concatenate(self.x) if self.x else np.zeros(0)
        s = np.concatenate(self.s) if self.s else np.zeros(0, np.int64)
        count = np.bincount(s, minlength=self.S).astype(np.float64)
        mean = np.array([x[s == k].mean() if count[k] else 0.0 for k in range(self.S)])
        var = np.array([x[s == k].var() if count[k] else np.nan for k in range(self.S)])
        return count, mean, var

    def normalise(self, rewards: torch.Tensor, seg: torch.Tensor | None, clip: float, eps: float = 1e-8):
        count, mean, var = self.stats()
        r = rewards.double().reshape(-1).numpy()
        s = np.zeros(r.shape, np.int64) if seg is None else seg.reshape(-1).numpy()
        has = count[s] > 0
        out = np.where(has, (r - mean[s]) / np.sqrt(np.where(has, var[s], 0.0) + eps), r)
        return torch.from_numpy(np.clip(out, -clip, clip)).reshape(rewards.shape)


def assert_stats(state: K.RunningMoments, ref: Reference, rtol: float = 1e-12) -> None:
    count, mean, var = ref.stats()
    np.testing.assert_array_equal(state.count.numpy(), count)
    seen = count > 0
    np.testing.assert_allclose(state.mean.numpy()[seen], mean[seen], rtol=rtol, atol=0)
    np.testing.assert_allclose(state.var.numpy()[seen], var[seen], rtol=rtol, atol=0)


def assert_output(out: torch.Tensor, want: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == want.shape
    # the write pass computes in float32: a few ulps of the normalised value
    err = (out.double() - want).abs()
    bad = ~(err <= 2e-6 + 2e-6 * want.abs())  # NaN counts as bad
    assert not bool(bad.any()), f"{int(bad.sum())} mismatches, max abs err {err.max().item():.3g}"


def snapshot(state: K.RunningMoments) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.state_dict().items()}


def assert_same_state(state: K.RunningMoments, snap: dict[str, torch.Tensor]) -> None:
    for k, v in state.state_dict().items():
        assert torch.equal(v, snap[k]), k


# ---- against the float64 reference -----------------------------------------------------------------------
def check_against_reference(shape, dtype, S: int) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{shape}{dtype}{S}".encode()))
    state, ref = K.RunningMoments(num_segments=S), Reference(S)
    for size in (shape, (int(rng.integers(1, 50)),)):  # a second batch on top of the first's statistics
        r = rewards_like(rng, size, dtype)
        seg = segments(rng, size, S) if S > 1 else None
        out = K.normalize_rewards(r, state, segment_ids=seg, clip=5.0)
        ref.add(r, seg)
        assert_stats(state, ref)
        assert_output(out, ref.normalise(r, seg, clip=5.0))


@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(1,), (37, 129), (1000,), (100_003,)], ids=str)
@pytest.mark.parametrize("backend_name", ["torch", "cpp"])
def test_matches_float64_reference(backend_name, shape, dtype, S):
    set_backend(backend_name)
    try:
        check_against_reference(shape, dtype, S)
    finally:
        set_backend(None)


@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(1,), (3, 29), (300,)], ids=str)
def test_triton_matches_float64_reference(shape, dtype, S):
    pytest.importorskip("triton")
    set_backend("triton")
    try:
        check_against_reference(shape, dtype, S)
    finally:
        set_backend(None)


@pytest.mark.parametrize("max_partials", [1 << 22, 8], ids=["one-sub-block-per-chunk", "five-per-chunk"])
def test_triton_multi_chunk_paths(monkeypatch, max_partials):
    """Shrunk tiles, so tiny inputs take the paths big ones take: many chunks merged a tile at a time,
    and chunks of several sub-blocks Chan-merged inside kernel 1."""
    pytest.importorskip("triton")
    from palestra.kernels import triton_reward_norm as TR

    monkeypatch.setattr(TR, "SUB", 16)
    monkeypatch.setattr(TR, "MAX_CHUNK_TILE", 4)
    monkeypatch.setattr(TR, "MAX_PARTIALS", max_partials)
    set_backend("triton")
    try:
        for S in (1, 2):
            check_against_reference((300,), torch.float32, S)
    finally:
        set_backend(None)


def test_sequential_batches_equal_one_big_batch(backend):
    rng = np.random.default_rng(1)
    S = 2
    sizes = [1, 7, 3, 1, 40, 2, 19] if backend == "triton" else [1, 1000, 3, 12_345, 1, 70_001, 513]
    batches = [(rewards_like(rng, (n,)), segments(rng, (n,), S)) for n in sizes]
    running, whole = K.RunningMoments(S), K.RunningMoments(S)
    for r, seg in batches:
        K.normalize_rewards(r, running, segment_ids=seg)
    whole.update(torch.cat([r for r, _ in batches]), torch.cat([s for _, s in batches]))
    assert torch.equal(running.count, whole.count)
    torch.testing.assert_close(running.mean, whole.mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(running.m2, whole.m2, rtol=1e-12, atol=0)


def test_merge_of_shard_states_equals_the_whole(cpp):
    rng = np.random.default_rng(2)
    S = 3
    r = rewards_like(rng, (200_003,), torch.float64)
    seg = segments(rng, r.shape, S)
    cuts = [0, 1, 17, 5000, 60_000, 60_001, 150_000, r.numel()]  # K = 7 shards of unequal sizes, one of size 1
    merged = K.RunningMoments(S)
    for a, b in itertools.pairwise(cuts):
        merged.merge(K.RunningMoments(S).update(r[a:b], seg[a:b]))
    whole = K.RunningMoments(S).update(r, seg)
    assert torch.equal(merged.count, whole.count)
    torch.testing.assert_close(merged.mean, whole.mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(merged.m2, whole.m2, rtol=1e-12, atol=0)
    snap = snapshot(merged)
    merged.merge(K.RunningMoments(S))  # merging an empty state changes nothing, bit for bit
    assert_same_state(merged, snap)


@pytest.mark.parametrize("backend_name", ["torch", "cpp"])
def test_variance_survives_a_large_offset(backend_name):
    """Sum / sum-of-squares would lose every digit here (1e7 offset, unit spread); the kernels keep ~1e-9."""
    set_backend(backend_name)
    try:
        rng = np.random.default_rng(3)
        x = torch.from_numpy(1e7 + rng.normal(0.0, 1.0, size=100_003))
        state = K.RunningMoments().update(x)
        want = x.numpy().var()
        assert abs(state.var.item() - want) <= 1e-9 * want
        assert abs(state.mean.item() - x.numpy().mean()) <= 1e-13 * 1e7
    finally:
        set_backend(None)


def test_segments_of_unequal_sizes_with_an_empty_one(backend):
    rng = np.random.default_rng(4)
    S = 5
    sizes = [1, 6, 3, 0, 9] if backend == "triton" else [1, 200, 17, 0, 5000]  # segment 3 empty in the batch
    state, ref = K.RunningMoments(S), Reference(S)
    prior = torch.tensor([3.5, -1.0, 8.0], dtype=torch.float32)
    prior_seg = torch.tensor([3, 3, 0])  # segment 3 has history; segment 4's first samples come now
    K.normalize_rewards(prior, state, prior_seg)
    ref.add(prior, prior_seg)
    before3 = (state.count[3].item(), state.mean[3].item(), state.m2[3].item())
    seg = torch.from_numpy(rng.permutation(np.repeat(np.arange(S), sizes)))
    r = rewards_like(rng, seg.shape)
    out = K.normalize_rewards(r, state, seg.to(torch.int32))  # any integer dtype is accepted
    ref.add(r, seg)
    assert_stats(state, ref)
    assert_output(out, ref.normalise(r, seg, clip=5.0))
    assert (state.count[3].item(), state.mean[3].item(), state.m2[3].item()) == before3


@pytest.mark.parametrize("S", [3, 6, 3000], ids=["dense", "scatter", "scatter-tracked"])
def test_cpp_segment_paths(cpp, S):
    """The C++ kernel has three segmented paths (masked passes for S <= 4, a banked scatter, and a scatter
    that tracks the segments present once S is large); each against the reference, with its errors."""
    rng = np.random.default_rng(S)
    n = 150_001
    state, ref = K.RunningMoments(S), Reference(S)
    for size in (n, 1000):
        r = rewards_like(rng, (size,), torch.bfloat16)
        seg = torch.from_numpy(rng.integers(0, S // 2 + 1, size=size) * 2 % S)  # some segments never appear
        out = K.normalize_rewards(r, state, seg)
        ref.add(r, seg)
        assert_stats(state, ref)
        assert_output(out, ref.normalise(r, seg, clip=5.0))
    snap = snapshot(state)
    r, seg = rewards_like(rng, (n,)), segments(rng, (n,), S)
    r[70_000], r[140_000] = math.inf, math.nan
    text = one_line_error(ValueError, lambda: K.normalize_rewards(r, state, seg))
    assert "has 2 non-finite value(s) (NaN/inf), the first at flat index 70000" in text
    r = rewards_like(rng, (n,))
    seg[99_999], seg[100_000] = S, -5
    text = one_line_error(ValueError, lambda: K.normalize_rewards(r, state, seg))
    assert f"segment_ids has value {S} at flat index 99999; ids must lie in [0, S) with S={S}" in text
    assert_same_state(state, snap)


def test_single_reward_on_a_fresh_state_normalises_to_zero(backend):
    state = K.RunningMoments()
    out = K.normalize_rewards(torch.tensor([4.25]), state)
    assert out.tolist() == [0.0]
    assert state.count.item() == 1 and state.mean.item() == 4.25 and state.m2.item() == 0.0


def test_clip(backend):
    rng = np.random.default_rng(5)
    n = 64 if backend == "triton" else 10_000
    r = rewards_like(rng, (n,))
    r[3], r[9] = 1e4, -1e4  # far outliers
    for clip, bound in ((2.0, 2.0), (None, math.inf), (math.inf, math.inf)):
        state = K.RunningMoments()
        out = K.normalize_rewards(r, state, clip=clip)
        ref = Reference(1)
        ref.add(r, None)
        assert_output(out, ref.normalise(r, None, clip=bound))
        if bound == 2.0:
            assert out.abs().max().item() == 2.0 and out[3].item() == 2.0 and out[9].item() == -2.0
        else:
            assert out[3].item() > 5.0 and out[9].item() < -5.0


def test_update_false_uses_and_keeps_the_state(backend):
    rng = np.random.default_rng(6)
    S = 3
    n = 50 if backend == "triton" else 20_000
    state, ref = K.RunningMoments(S), Reference(S)
    r0, s0 = rewards_like(rng, (n,)), segments(rng, (n,), S)
    K.normalize_rewards(r0, state, s0)
    ref.add(r0, s0)
    snap = snapshot(state)
    r, seg = rewards_like(rng, (n,), torch.bfloat16, loc=-1.0), segments(rng, (n,), S)
    out = K.normalize_rewards(r, state, seg, update=False, clip=4.0)
    assert_same_state(state, snap)
    assert_output(out, ref.normalise(r, seg, clip=4.0))


def test_update_false_on_a_fresh_state_passes_rewards_through_clipped(backend):
    fresh = K.RunningMoments(2)
    r = torch.tensor([[0.5, -7.0, 3.0], [9.0, -0.25, 1.0]])
    seg = torch.tensor([[0, 1, 1], [0, 0, 1]])
    out = K.normalize_rewards(r, fresh, seg, update=False, clip=5.0)
    assert torch.equal(out, r.clamp(-5.0, 5.0))
    assert fresh.count.tolist() == [0.0, 0.0]


def test_cpp_statistics_do_not_depend_on_the_thread_count(cpp):
    rng = np.random.default_rng(7)
    r = rewards_like(rng, (300_001,))
    seg = segments(rng, r.shape, 4)
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, max(2, threads)):
            torch.set_num_threads(t)
            a, b = K.RunningMoments(), K.RunningMoments(4)
            results.append((K.normalize_rewards(r, a), K.normalize_rewards(r, b, seg), a.state_dict(), b.state_dict()))
    finally:
        torch.set_num_threads(threads)
    (o1, p1, a1, b1), (o2, p2, a2, b2) = results
    assert torch.equal(o1, o2) and torch.equal(p1, p2)
    for k in a1:
        assert torch.equal(a1[k], a2[k]) and torch.equal(b1[k], b2[k]), k


# ---- RunningMoments --------------------------------------------------------------------------------------
def test_state_dict_round_trip(cpp):
    rng = np.random.default_rng(8)
    state = K.RunningMoments(3)
    state.update(rewards_like(rng, (999,)), segments(rng, (999,), 3))
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    restored = K.RunningMoments(3)
    restored.load_state_dict(torch.load(buf))
    assert_same_state(restored, snapshot(state))
    r, seg = rewards_like(rng, (77,)), segments(rng, (77,), 3)
    assert torch.equal(K.normalize_rewards(r, state, seg), K.normalize_rewards(r, restored, seg))
    assert_same_state(restored, snapshot(state))
    with pytest.raises(ValueError, match=r"state_dict\['m2'\] has shape \[2\], expected \[3\]"):
        restored.load_state_dict({**state.state_dict(), "m2": torch.zeros(2)})
    with pytest.raises(KeyError, match="missing keys \\['count'\\]"):
        restored.load_state_dict({"mean": state.mean, "m2": state.m2})


def test_running_moments_views_and_repr(cpp):
    state = K.RunningMoments(2)
    assert state.num_segments == 2 and state.device == torch.device("cpu")
    assert torch.isnan(state.var).all()  # no samples yet
    state.update(torch.tensor([1.0, 3.0, 10.0, 10.0]), torch.tensor([0, 0, 1, 1]))
    assert state.mean.tolist() == [2.0, 10.0]
    assert state.var.tolist() == [1.0, 0.0] and state.std.tolist() == [1.0, 0.0]
    assert repr(state) == "RunningMoments(num_segments=2, device=cpu, count=[2, 2], mean=[2, 10], std=[1, 0])"
    long_repr = repr(K.RunningMoments(7))
    assert long_repr.startswith("RunningMoments(num_segments=7, device=cpu, count=[0, 0, 0, 0, 0, 0, ...]")
    assert state.to("cpu") is state
    assert state.all_reduce() is state and state.mean.tolist() == [2.0, 10.0]  # no process group: a no-op
    with pytest.raises(ValueError, match="num_segments must be an int >= 1"):
        K.RunningMoments(0)
    with pytest.raises(ValueError, match="other has 3 segments, this state has 2"):
        state.merge(K.RunningMoments(3))


# ---- torch.library integration ----------------------------------------------------------------------------
def test_opcheck_native_op():
    CPU_LIBRARY.load()
    rng = np.random.default_rng(9)
    op = torch.ops.palestra.normalize_rewards.default
    for seg, S, update in ((None, 1, False), (segments(rng, (300,), 3), 3, True)):
        state = K.RunningMoments(S)
        state.update(rewards_like(rng, (50,)), None if seg is None else seg[:50])
        args = (rewards_like(rng, (300,)), seg, state.count, state.mean, state.m2, 5.0, 1e-8, update)
        torch.library.opcheck(op, args)


def test_opcheck_triton_op():
    pytest.importorskip("triton")
    from palestra.kernels import triton_reward_norm

    rng = np.random.default_rng(10)
    state = K.RunningMoments(2)
    args = (rewards_like(rng, (20,)), segments(rng, (20,), 2), state.count, state.mean, state.m2, 5.0, 1e-8, True)
    torch.library.opcheck(triton_reward_norm.normalize_rewards_op, args)


def test_torch_compile_fullgraph_cpp(cpp):
    rng = np.random.default_rng(11)
    r, seg = rewards_like(rng, (4, 257)), segments(rng, (4, 257), 2)

    def step(rewards, state, segment_ids):
        return K.normalize_rewards(rewards * 0.5 + 1.0, state, segment_ids=segment_ids, clip=3.0) * 2.0

    # aot_eager: Dynamo + AOTAutograd (functionalisation of the in-place state update, fake kernels) without
    # Inductor's C++ compile, which would cost CI seconds to tens of seconds; Inductor was checked by hand.
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_state, compiled_state = K.RunningMoments(2), K.RunningMoments(2)
    for _ in range(2):  # the second call must see the first call's in-place update
        got = compiled(r, compiled_state, seg)
        want = step(r, eager_state, seg)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert_same_state(compiled_state, snapshot(eager_state))


# ---- distributed ----------------------------------------------------------------------------------------
def _all_reduce_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One rank: local batches, then a sync, twice (the second sync must not recount the first round)."""
    import traceback

    import torch.distributed as dist

    try:
        torch.set_num_threads(1)  # a forked child must not start OpenMP teams of its own
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
        g = torch.Generator().manual_seed(100 + rank)
        state, seen = K.RunningMoments(3), []
        for rnd in range(2):
            for _ in range(3):
                n = int(torch.randint(1, 400, (1,), generator=g))
                r = torch.randn(n, generator=g, dtype=torch.float64) * 2 + 3 + rank
                seg = torch.randint(0, 3, (n,), generator=g)
                K.normalize_rewards(r, state, seg)
                seen.append((r, seg))
            state.all_reduce()
            torch.save({"state": state.state_dict(), "seen": list(seen)}, f"{out_dir}/r{rnd}_{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{out_dir}/error_{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        raise


def test_all_reduce_across_two_gloo_processes(tmp_path):
    """Two real ranks (gloo); forked so they start in a fraction of a second with everything imported."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    # Build here, once, rather than racing in both workers; if it fails, the workers fall back to the torch back
    # end, with a warning.
    with contextlib.suppress(KernelBuildError):
        CPU_LIBRARY.load()
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    procs = [
        ctx.Process(target=_all_reduce_worker, args=(rank, 2, str(tmp_path / "init"), str(tmp_path)))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = "".join(f.read_text() for f in sorted(tmp_path.glob("error_*.txt")))
    assert [p.exitcode for p in procs] == [0, 0], errors[-3000:]
    for rnd in range(2):
        r0, r1 = (torch.load(tmp_path / f"r{rnd}_{rank}.pt") for rank in range(2))
        for key in ("count", "mean", "m2"):
            assert torch.equal(r0["state"][key], r1["state"][key]), (rnd, key)  # bitwise identical on both ranks
        ref = Reference(3)
        for r, seg in r0["seen"] + r1["seen"]:
            ref.add(r, seg)
        count, mean, var = ref.stats()
        st = r0["state"]
        np.testing.assert_array_equal(st["count"].numpy(), count)
        np.testing.assert_allclose(st["mean"].numpy(), mean, rtol=1e-12)
        np.testing.assert_allclose((st["m2"] / st["count"]).numpy(), var, rtol=1e-12)


# ---- errors: one line, naming the culprit ----------------------------------------------------------------
def one_line_error(exc_type, fn) -> str:
    with pytest.raises(exc_type) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text.strip(), text
    return text


def test_bad_segment_ids_raise_naming_value_and_S(backend):
    state = K.RunningMoments(3)
    snap = snapshot(state)
    r = torch.randn(40) + 3
    for bad, where in ((3, 7), (-1, 0), (99, 39)):
        seg = torch.zeros(40, dtype=torch.int64)
        seg[where] = bad
        seg[where + 1 :] = bad  # later bad ids too: the first one is named
        for update in (True, False):
            text = one_line_error(
                ValueError, lambda seg=seg, update=update: K.normalize_rewards(r, state, seg, update=update)
            )
            assert text == (
                f"normalize_rewards: segment_ids has value {bad} at flat index {where}; ids must lie in [0, S) "
                "with S=3 (the state's num_segments)"
            )
    assert_same_state(state, snap)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in Triton's interpreter
def test_non_finite_rewards_raise_with_count_and_first_index(backend):
    state = K.RunningMoments(2)
    K.normalize_rewards(torch.tensor([1.0, 2.0, 4.0]), state, torch.tensor([0, 1, 1]))
    snap = snapshot(state)
    n = 64 if backend == "triton" else 100_000
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        r = (torch.randn(n) + 3).to(dtype)
        r[n // 3], r[n // 2], r[n - 1] = float("nan"), float("inf"), -float("inf")
        seg = torch.randint(0, 2, (n,))
        for update in (True, False):
            text = one_line_error(
                ValueError, lambda r=r, seg=seg, update=update: K.normalize_rewards(r, state, seg, update=update)
            )
            name = str(dtype).removeprefix("torch.")
            assert text == (
                f"normalize_rewards: rewards ({name}, {n} elements) has 3 non-finite value(s) (NaN/inf), "
                f"the first at flat index {n // 3}"
            )
        one_line_error(ValueError, lambda r=r: K.normalize_rewards(r, K.RunningMoments()))  # unsegmented path too
    assert_same_state(state, snap)


def test_argument_errors_name_the_argument():
    state = K.RunningMoments(2)
    r = torch.randn(4, 5)
    seg = torch.zeros(4, 5, dtype=torch.int64)
    assert "segment_ids has shape [20], expected the shape of rewards [4, 5]" in one_line_error(
        ValueError, lambda: K.normalize_rewards(r, state, seg.reshape(-1))
    )
    assert "segment_ids has dtype float32" in one_line_error(
        TypeError, lambda: K.normalize_rewards(r, state, seg.float())
    )
    assert "segment_ids is required when the state has S=2 segments" in one_line_error(
        ValueError, lambda: K.normalize_rewards(r, state)
    )
    assert "rewards has dtype int64" in one_line_error(TypeError, lambda: K.normalize_rewards(seg, state, seg))
    meta_state = K.RunningMoments(2, device="meta")
    assert "state is on meta but rewards [4, 5] (float32) are on cpu" in one_line_error(
        ValueError, lambda: K.normalize_rewards(r, meta_state, seg)
    )
    for clip in (0.0, -1.0, float("nan")):
        assert "clip must be > 0" in one_line_error(
            ValueError, lambda clip=clip: K.normalize_rewards(r, state, seg, clip=clip)
        )
    assert "eps must be a finite float >= 0" in one_line_error(
        ValueError, lambda: K.normalize_rewards(r, state, seg, eps=-1e-3)
    )
    assert state.count.tolist() == [0.0, 0.0]


def test_native_op_rejects_bad_arguments_itself():
    """The C++ kernel checks what the wrapper guarantees, for direct torch.ops callers."""
    CPU_LIBRARY.load()
    op = torch.ops.palestra.normalize_rewards
    st = K.RunningMoments(2)
    r, ids = torch.randn(10), torch.zeros(10, dtype=torch.int64)
    text = one_line_error(ValueError, lambda: op(r, ids[:9], st.count, st.mean, st.m2, 5.0, 1e-8, True))
    assert "segment_ids must be a contiguous int64 CPU tensor of shape [10]" in text
    text = one_line_error(ValueError, lambda: op(r, None, st.count, st.mean, st.m2, 5.0, 1e-8, True))
    assert "segment_ids is required when the state has S=2 segments" in text
    text = one_line_error(ValueError, lambda: op(r, ids, st.count, st.mean.float(), st.m2, 5.0, 1e-8, True))
    assert "mean must be a contiguous float64 CPU tensor of shape [2]" in text
    text = one_line_error(ValueError, lambda: op(r, ids, st.count, st.mean, st.m2, 0.0, 1e-8, True))
    assert "clip must be > 0" in text


# ---- back-end choice ---------------------------------------------------------------------------------------
def test_backend_forcing(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("PALESTRA_KERNELS", "torch")
    assert RN._op.backend_for(cpu) == "torch"
    monkeypatch.delenv("PALESTRA_KERNELS")
    set_backend("cuda")
    try:
        with pytest.raises(KernelBuildError, match="cuda back end runs on CUDA tensors"):
            K.normalize_rewards(torch.randn(3), K.RunningMoments())
    finally:
        set_backend(None)
    assert RN._op.backend_for(cpu) in ("cpp", "torch")


# ---- the CUDA kernels, run on the CPU under an emulation of the CUDA subset they use -----------------------
# Nothing CUDA runs on CI, but the kernels' logic can: csrc/cuda/reward_norm.cu is compiled by g++ against the
# header below, which runs each block's threads as fibers, __syncthreads as a barrier and a warp's shuffles
# through a buffer between two warp barriers. The kernel source runs unchanged (only the <<<...>>> launch
# syntax is rewritten), so its indexing, reductions, merge order and error records are checked against the
# float64 reference. What it cannot check: the GPU memory model beyond barriers, and speed.
_EMU_RUNTIME = r"""
#pragma once
// Each CUDA thread of a block is a fiber (ucontext) on one OS thread; barriers (__syncthreads, and the
// per-warp one behind each shuffle) yield to the next fiber until every participant has arrived.
#include <ucontext.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
typedef void* cudaStream_t;
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static  /* blocks run one after another, so one copy per kernel is enough */
namespace emu {
struct Fiber { ucontext_t ctx; std::unique_ptr<char[]> stack; bool done = false; };
constexpr size_t kStack = 64 * 1024;
inline ucontext_t scheduler;
inline Fiber* current = nullptr;
inline unsigned long progress = 0;  // barrier phases completed + fibers finished: a stall detector
inline dim3 thread_idx, block_idx, block_dim, grid_dim;
inline int lane = 0;
inline std::function<void()>* body = nullptr;
inline void yield() { swapcontext(&current->ctx, &scheduler); }
struct Barrier {
  unsigned expected, arrived = 0;
  unsigned long generation = 0;
  void wait() {
    const unsigned long g = generation;
    if (++arrived == expected) { arrived = 0; ++generation; ++progress; return; }
    while (generation == g) yield();
  }
};
inline Barrier block_barrier{0};
inline std::vector<Barrier> warp_barriers;
inline std::vector<unsigned char> warp_slots;  // [warps][32][8]
inline void trampoline() { (*body)(); current->done = true; ++progress; }
template <class T> T shuffle(T v, int src) {
  const unsigned w = thread_idx.x / 32;
  unsigned char* slots = warp_slots.data() + w * 32 * 8;
  std::memcpy(slots + lane * 8, &v, sizeof(T));
  warp_barriers[w].wait();
  T out;
  std::memcpy(&out, slots + src * 8, sizeof(T));
  warp_barriers[w].wait();
  return out;
}
template <class F> void launch(dim3 grid, dim3 threads, F kernel) {
  std::function<void()> fn = kernel;
  body = &fn;
  const unsigned n = threads.x, warps = (n + 31) / 32;
  std::vector<Fiber> fibers(n);
  for (Fiber& f : fibers) f.stack.reset(new char[kStack]);  // uninitialised: only touched pages cost
  for (unsigned b = 0; b < grid.x; ++b) {
    block_barrier = Barrier{n};
    warp_barriers.assign(warps, Barrier{32});
    warp_slots.assign(warps * 32 * 8, 0);
    for (Fiber& f : fibers) {
      f.done = false;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = &scheduler;
      makecontext(&f.ctx, trampoline, 0);
    }
    for (bool running = true; running;) {
      running = false;
      const unsigned long before = progress;
      for (unsigned t = 0; t < n; ++t) {
        if (fibers[t].done) continue;
        running = true;
        current = &fibers[t];
        thread_idx = dim3(t); block_idx = dim3(b); block_dim = threads; grid_dim = grid; lane = t % 32;
        swapcontext(&scheduler, &current->ctx);
      }
      if (running && progress == before) { std::fprintf(stderr, "emulated CUDA: barrier deadlock\n"); std::abort(); }
    }
  }
}
}  // namespace emu
#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim
template <class T> T __shfl_xor_sync(unsigned, T v, int mask) { return emu::shuffle(v, emu::lane ^ mask); }
inline void __syncthreads() { emu::block_barrier.wait(); }
using std::isfinite; using std::min; using std::sqrt;
"""
_EMU_BF16 = r"""
#pragma once
#include <cstring>
struct __nv_bfloat16 { unsigned short bits; };
inline float __bfloat162float(__nv_bfloat16 b) {
  unsigned u = unsigned(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
"""
_EMU_FP16 = r"""
#pragma once
#include <cstring>
struct __half { unsigned short bits; };
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.bits, 2); return static_cast<float>(f); }
"""


def _build_emulated_cuda(build_dir):
    import ctypes
    import re
    import shutil
    import subprocess

    from palestra.kernels.build import csrc_dir

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    probe = build_dir / "probe.cpp"
    probe.write_text("#include <ucontext.h>\nint main() { ucontext_t c; return getcontext(&c); }\n")
    if subprocess.run([gxx, str(probe), "-o", str(build_dir / "probe")], capture_output=True).returncode:
        pytest.skip("no <ucontext.h> to run emulated CUDA threads on")
    source = (csrc_dir() / "cuda" / "reward_norm.cu").read_text()
    launch = re.compile(r"([A-Za-z_]\w*(?:<[^<>]*>)?)\s*<<<(.*?)>>>\s*\((.*?)\);", re.S)

    def as_emulated_launch(m):
        grid, threads = [part.strip() for part in m.group(2).split(",")[:2]]
        return f"emu::launch(dim3({grid}), dim3({threads}), [&] {{ {m.group(1)}({m.group(3)}); }});"

    source, launches = launch.subn(as_emulated_launch, source)
    assert launches == 3, f"expected the three kernel launches in reward_norm.cu, found {launches}"
    (build_dir / "cuda_runtime.h").write_text(_EMU_RUNTIME)
    (build_dir / "cuda_bf16.h").write_text(_EMU_BF16)
    (build_dir / "cuda_fp16.h").write_text(_EMU_FP16)
    (build_dir / "reward_norm_emulated.cpp").write_text(source)
    (build_dir / "entry.cpp").write_text(
        '#include "reward_norm_emulated.cpp"\n'
        'extern "C" int emu_plan(int64_t n, int64_t S, bool update, int64_t* out) {\n'
        "  const auto p = palestra::cuda::reward_norm_plan(n, S, update);\n"
        "  out[0] = p.num_chunks; out[1] = p.chunk; out[2] = p.partial_doubles; out[3] = p.chunk_error_slots;\n"
        "  return 0;\n}\n"
        'extern "C" int emu_normalize(const void* r, int dtype, const int64_t* seg, int64_t n, int64_t S,\n'
        "    double* count, double* mean, double* m2, double clip, "
        "double eps, bool update, float* out, double* partials,\n"
        "    int64_t* chunk_errors, int64_t* error_out, double* coefficients) {\n"
        "  const auto kind = static_cast<palestra::cuda::RewardDType>(dtype);\n"
        "  return palestra::cuda::launch_normalize_rewards(r, "
        "kind, seg, n, S, count, mean, m2, clip, eps, update, out,\n"
        "      partials, chunk_errors, error_out, coefficients, nullptr);\n}\n"
    )
    lib_path = build_dir / "reward_norm_emulated.so"
    cmd = [
        gxx,
        "-std=c++17",
        "-O1",
        "-shared",
        "-fPIC",
        "-fno-gnu-unique",
        "-I",
        str(build_dir),
        "-I",
        str(csrc_dir() / "cuda"),
        str(build_dir / "entry.cpp"),
        "-o",
        str(lib_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = ctypes.CDLL(str(lib_path))
    P, I64, F64, B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_bool
    lib.emu_plan.argtypes = [I64, I64, B, P]
    lib.emu_normalize.argtypes = [P, ctypes.c_int, P, I64, I64, P, P, P, F64, F64, B, P, P, P, P, P]
    return lib


@pytest.fixture(scope="module")
def emulated_cuda(tmp_path_factory):
    return _build_emulated_cuda(tmp_path_factory.mktemp("reward_norm_cuda_emulated"))


def run_emulated(lib, rewards, seg, state: K.RunningMoments, clip=5.0, eps=1e-8, update=True):
    """The binding's job, in Python: plan, workspace, launch; returns (out, error record)."""
    import ctypes

    kinds = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
    n, S = rewards.numel(), state.num_segments
    plan = (ctypes.c_int64 * 4)()
    lib.emu_plan(n, S, update, plan)
    partials = torch.full((max(1, plan[2]),), math.nan, dtype=torch.float64)
    chunk_errors = torch.full((plan[3],), -7, dtype=torch.int64)
    error_out = torch.full((4,), -7, dtype=torch.int64)
    coefficients = torch.full((2 * S,), math.nan, dtype=torch.float64)
    out = torch.full((n,), 99.0)
    rc = lib.emu_normalize(
        rewards.data_ptr(),
        kinds[rewards.dtype],
        None if seg is None else seg.data_ptr(),
        n,
        S,
        state.count.data_ptr(),
        state.mean.data_ptr(),
        state.m2.data_ptr(),
        clip,
        eps,
        update,
        out.data_ptr(),
        partials.data_ptr(),
        chunk_errors.data_ptr(),
        error_out.data_ptr(),
        coefficients.data_ptr(),
    )
    assert rc == 0
    return out, error_out.tolist()


@pytest.mark.parametrize(
    "n, S, dtype",
    # two chunks at n > 4096; S = 40 and 130 take the 4- and 1-lane-per-segment paths
    [
        (1, 1, torch.float32),
        (4500, 1, torch.float32),
        (4500, 3, torch.bfloat16),
        (1000, 40, torch.float16),
        (600, 130, torch.float32),
        (10, 7, torch.float64),
    ],
    ids=str,
)
@pytest.mark.slow
def test_cuda_kernels_emulated_match_reference(emulated_cuda, n, S, dtype):
    rng = np.random.default_rng(zlib.crc32(f"cuda{n}{S}{dtype}".encode()))
    state, ref = K.RunningMoments(S), Reference(S)
    for size in (int(rng.integers(1, 100)), n):
        r = rewards_like(rng, (size,), dtype)
        seg = segments(rng, (size,), S) if S > 1 else None
        if seg is not None and S > 2:
            seg[seg == 1] = 2  # segment 1 stays empty
        out, errors = run_emulated(emulated_cuda, r, seg, state)
        assert errors == [0, -1, -1, 0]
        ref.add(r, seg)
        assert_stats(state, ref)
        assert_output(out, ref.normalise(r, seg, clip=5.0))
    snap = snapshot(state)
    out, errors = run_emulated(emulated_cuda, r, seg, state, clip=math.inf, update=False)
    assert errors == [0, -1, -1, 0]
    assert_same_state(state, snap)
    assert_output(out, ref.normalise(r, seg, clip=math.inf))


def test_cuda_kernels_emulated_report_bad_batches_and_keep_the_state(emulated_cuda):
    rng = np.random.default_rng(12)
    state = K.RunningMoments(4)
    run_emulated(emulated_cuda, rewards_like(rng, (100,)), segments(rng, (100,), 4), state)
    snap = snapshot(state)
    r, seg = rewards_like(rng, (4500,)), segments(rng, (4500,), 4)  # two chunks: the errors sit in the second
    r[3000], r[4000], r[4499] = math.nan, math.inf, -math.inf
    out, errors = run_emulated(emulated_cuda, r, seg, state)
    assert errors == [3, 3000, -1, 0] and bool((out == 99.0).all())
    r = rewards_like(rng, (4500,))
    seg[3300], seg[4100] = 4, -3
    for update in (True, False):
        out, errors = run_emulated(emulated_cuda, r, seg, state, update=update)
        assert errors == [0, -1, 3300, 4] and bool((out == 99.0).all())
    assert_same_state(state, snap)
