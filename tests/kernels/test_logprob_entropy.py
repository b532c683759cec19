"""palestra.kernels.logprob_entropy on every back end that runs here (torch, cpp, triton under the
interpreter) against a float64 reference written in this file, values and gradients.

The CUDA kernels cannot run without a GPU; their logic (alignment heads, the unrolled main loop, the
per-thread online state and its warp / block merge, the backward's vector stores) is checked by compiling
logprob_entropy.cu for the host with a small emulation of CUDA (test_cuda_kernels_under_host_emulation).
"""

from __future__ import annotations

import ctypes
import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import palestra.kernels as K
from palestra.kernels.build import CPU_LIBRARY, KernelBuildError, csrc_dir

# The module itself (the attribute palestra.kernels.logprob_entropy is the public function).
LE = importlib.import_module("palestra.kernels.logprob_entropy")
IGNORE = -100
_seed = [1234]


def fresh_generator() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator().manual_seed(_seed[0] * 7919)


# ---- float64 reference, independent of palestra's torch back end -------------------------------------
def reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, ignore_index: int = IGNORE):
    """(logp, entropy) in float64 from the float64 value of ``logits`` (autograd flows to ``logits``)."""
    z = logits.double() / temperature
    log_p = torch.log_softmax(z, dim=-1)
    keep = tokens != ignore_index
    logp = log_p.gather(-1, torch.where(keep, tokens, 0).unsqueeze(-1)).squeeze(-1)
    entropy = torch.special.entr(log_p.exp()).sum(-1)  # entr(0) = 0: rows with -inf logits stay finite
    return torch.where(keep, logp, 0.0), torch.where(keep, entropy, 0.0)


def make_inputs(lead: tuple[int, ...], vocab: int, dtype=torch.float32, scale=3.0, ignored=0.25):
    gen = fresh_generator()
    logits = (torch.randn(*lead, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    tokens = torch.randint(0, vocab, lead, generator=gen)
    tokens[torch.rand(lead, generator=gen) < ignored] = IGNORE
    return logits, tokens


def check_against_reference(logits, tokens, temperature, *, atol, rtol, grad_rtol, grad_atol, backend=None):
    """Values and gradients (random upstream grads for both outputs) vs the float64 reference."""
    gen = fresh_generator()
    g_logp = torch.randn(tokens.shape, generator=gen)
    g_ent = torch.randn(tokens.shape, generator=gen)
    x = logits.clone().requires_grad_(True)
    logp, ent = K.logprob_entropy(x, tokens, temperature, backend=backend)
    assert logp.dtype == ent.dtype == torch.float32
    assert logp.shape == ent.shape == tokens.shape
    x_ref = logits.detach().double().requires_grad_(True)  # the same (rounded) inputs, in float64
    r_logp, r_ent = reference(x_ref, tokens, temperature)
    torch.testing.assert_close(logp.double(), r_logp.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(ent.double(), r_ent.detach(), atol=atol, rtol=rtol)
    assert (logp <= 0).all()
    (grad,) = torch.autograd.grad((logp, ent), x, (g_logp, g_ent))
    (r_grad,) = torch.autograd.grad((r_logp, r_ent), x_ref, (g_logp.double(), g_ent.double()))
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    torch.testing.assert_close(grad.double(), r_grad, atol=grad_atol, rtol=grad_rtol)
    ignored = tokens == IGNORE
    assert (logp[ignored] == 0).all() and (ent[ignored] == 0).all() and (grad[ignored] == 0).all()


@pytest.fixture(params=["torch", "cpp", "triton"])
def backend(request):
    K.set_backend(request.param)
    try:
        yield request.param
    finally:
        K.set_backend(None)


# The Triton interpreter is slow: small shapes for it, bigger ones (several 2048-column CPU blocks, a
# partial last block) for the others.
SHAPES = {
    "one-row": ((1,), 1000),
    "odd-vocab": ((3, 4), 257),
    "one-step": ((2, 1), 300),
    "many-blocks": ((5,), 5000),
    "block-edge": ((2, 3), 2049),
}
TRITON_SHAPES = {"one-row", "odd-vocab", "one-step"}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_float32_matches_float64_reference(backend, shape, temperature):
    if backend == "triton" and shape not in TRITON_SHAPES:
        pytest.skip("the Triton interpreter is slow: small shapes only")
    lead, vocab = SHAPES[shape]
    logits, tokens = make_inputs(lead, vocab)
    check_against_reference(logits, tokens, temperature, atol=2e-5, rtol=2e-5, grad_atol=1e-6, grad_rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(backend, dtype):
    lead, vocab = ((2, 3), 300) if backend == "triton" else ((3, 5), 3000)
    logits, tokens = make_inputs(lead, vocab, dtype=dtype)
    # fp32 math on the rounded inputs: values as tight as for fp32; the gradient is rounded to `dtype`.
    eps = torch.finfo(dtype).eps
    check_against_reference(logits, tokens, 1.3, atol=2e-5, rtol=2e-5, grad_atol=1e-6, grad_rtol=eps)


def test_rows_fully_ignored(backend):
    logits, _ = make_inputs((2, 3), 200)
    tokens = torch.full((2, 3), IGNORE)
    x = logits.clone().requires_grad_(True)
    logp, ent = K.logprob_entropy(x, tokens)
    assert (logp == 0).all() and (ent == 0).all()
    (grad,) = torch.autograd.grad((logp.sum() + ent.sum()), x)
    assert (grad == 0).all()


def test_one_output_only_gets_gradient(backend):
    """Backward with only one of the outputs used (the other's gradient is absent / zero)."""
    logits, tokens = make_inputs((4,), 260)
    for pick in (0, 1):
        x = logits.clone().requires_grad_(True)
        x_ref = logits.double().requires_grad_(True)
        out = K.logprob_entropy(x, tokens, 0.9)[pick]
        (grad,) = torch.autograd.grad(out.sum(), x)
        (r_grad,) = torch.autograd.grad(reference(x_ref, tokens, 0.9)[pick].sum(), x_ref)
        torch.testing.assert_close(grad.double(), r_grad, atol=1e-6, rtol=1e-4)


def test_extreme_logits_keep_logp_nonpositive(backend):
    vocab = 300 if backend == "triton" else 3000
    gen = fresh_generator()
    big = torch.randn(3, vocab, generator=gen, dtype=torch.float64) * 1e4  # one token takes all the mass
    offset = 1e6 + torch.randn(3, vocab, generator=gen, dtype=torch.float64)  # far from zero, flat
    for logits in (big.float(), offset.float()):
        tokens = logits.argmax(-1)  # logp ~ 0: where rounding could push it above zero
        tokens[2] = torch.randint(0, vocab, (1,), generator=gen)
        logp, ent = K.logprob_entropy(logits, tokens, 0.5)
        assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
        assert (logp <= 0).all() and (ent >= 0).all()
        r_logp, r_ent = reference(logits, tokens, 0.5)
        torch.testing.assert_close(logp.double(), r_logp, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(ent.double(), r_ent, atol=1e-3, rtol=1e-4)


def test_masked_vocabulary_entries(backend):
    """-inf logits (a masked vocabulary) are probability 0: finite outputs, zero gradient there."""
    vocab = 260 if backend == "triton" else 4500
    logits, tokens = make_inputs((4,), vocab, ignored=0.0)
    masked = torch.rand(logits.shape, generator=fresh_generator()) < 0.3
    masked[:, : vocab // 2] = True  # a fully masked leading run (more than one CPU block of 2048)
    masked[torch.arange(4), tokens] = False
    logits = logits.masked_fill(masked, float("-inf"))
    x = logits.clone().requires_grad_(True)
    logp, ent = K.logprob_entropy(x, tokens)
    r_logp, r_ent = reference(logits, tokens)
    torch.testing.assert_close(logp.double(), r_logp, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ent.double(), r_ent, atol=2e-5, rtol=2e-5)
    (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), x)
    assert torch.isfinite(grad).all() and (grad[masked].abs() < 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_portable_loops(monkeypatch, dtype):
    """The portable vector-extension loops that CPUs without AVX2 run (forced by the env var)."""
    monkeypatch.setenv("PALESTRA_CPU_PORTABLE", "1")
    logits, tokens = make_inputs((3, 2), 4500, dtype=dtype)
    grad_rtol = 1e-4 if dtype == torch.float32 else torch.finfo(dtype).eps
    check_against_reference(
        logits, tokens, 0.9, atol=2e-5, rtol=2e-5, grad_atol=1e-6, grad_rtol=grad_rtol, backend="cpp"
    )


# Columns where the C++ loops change hands: vector lanes (8 for AVX2 and the portable loops, 16 for
# AVX-512), the 2048-column blocks, and the scalar tail of a vocabulary that is not a multiple of 8.
_VOCAB_WITH_TAIL = 2 * 2048 + 13
_EDGE_TOKENS = [
    0,
    7,
    8,
    15,
    16,
    31,
    2047,
    2048,
    2049,
    _VOCAB_WITH_TAIL - 13,
    _VOCAB_WITH_TAIL - 6,
    _VOCAB_WITH_TAIL - 1,
]


@pytest.mark.parametrize("portable", [False, True], ids=["widest-simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_tokens_at_lane_block_and_tail_edges(monkeypatch, portable, dtype):
    """The token's term is added inside the vector loops (before streaming stores) or in the scalar
    tail: every kind of position gets the right value and gradient. Rows of 4109 fp32 columns are not
    32-byte aligned after the first, so aligned (streamed) and unaligned stores are both covered."""
    if portable:
        monkeypatch.setenv("PALESTRA_CPU_PORTABLE", "1")
    logits, _ = make_inputs((len(_EDGE_TOKENS),), _VOCAB_WITH_TAIL, dtype=dtype, ignored=0.0)
    tokens = torch.tensor(_EDGE_TOKENS)
    grad_rtol = 1e-4 if dtype == torch.float32 else torch.finfo(dtype).eps
    check_against_reference(
        logits, tokens, 0.8, atol=2e-5, rtol=2e-5, grad_atol=1e-6, grad_rtol=grad_rtol, backend="cpp"
    )


@pytest.mark.parametrize("portable", [False, True], ids=["widest-simd", "portable"])
@pytest.mark.parametrize("column", [5, 3000, _VOCAB_WITH_TAIL - 2], ids=["first-vector", "later-block", "tail"])
def test_cpp_nan_logits_propagate(monkeypatch, portable, column):
    """A NaN logit makes its row's outputs NaN (never a plausible finite number); other rows are exact."""
    if portable:
        monkeypatch.setenv("PALESTRA_CPU_PORTABLE", "1")
    logits, tokens = make_inputs((3,), _VOCAB_WITH_TAIL, ignored=0.0)
    logits[1, column] = float("nan")
    logp, ent = K.logprob_entropy(logits, tokens, backend="cpp")
    assert torch.isnan(ent[1]) and torch.isnan(logp[1])
    clean = torch.tensor([0, 2])
    r_logp, r_ent = reference(logits[clean], tokens[clean])
    torch.testing.assert_close(logp[clean].double(), r_logp, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ent[clean].double(), r_ent, atol=2e-5, rtol=2e-5)


def test_cpu_simd_level_names_the_loops_in_use(monkeypatch):
    from palestra.kernels.build import cpu_simd_level

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    expected = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags and " fma" in flags else "portable"
    assert cpu_simd_level() == expected
    monkeypatch.setenv("PALESTRA_CPU_PORTABLE", "1")
    assert cpu_simd_level() == "portable"


def test_strided_logits_and_int32_tokens():
    logits, tokens = make_inputs((6,), 400)
    wide = torch.randn(6, 512, generator=fresh_generator())
    wide[:, :400] = logits
    view = wide[:, :400]  # rows 512 apart: not contiguous
    assert not view.is_contiguous()
    got = K.logprob_entropy(view, tokens.to(torch.int32))
    want = K.logprob_entropy(logits, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unbatched_logits(backend):
    """logits [V] with a 0-d token: outputs are 0-d."""
    logits, tokens = make_inputs((), 300, ignored=0.0)
    check_against_reference(logits, tokens, 1.0, atol=2e-5, rtol=2e-5, grad_atol=1e-6, grad_rtol=1e-4)


def test_torch_reference_chunks_rows(monkeypatch):
    logits, tokens = make_inputs((7,), 500)
    monkeypatch.setattr(LE, "_REFERENCE_CHUNK_ELEMENTS", 1000)  # two rows per chunk, a short last chunk
    check_against_reference(logits, tokens, 1.0, atol=2e-5, rtol=2e-5, grad_atol=1e-6, grad_rtol=1e-4, backend="torch")


# ---- torch.library checks and torch.compile ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_native(dtype):
    CPU_LIBRARY.load()
    logits, tokens = make_inputs((7,), 300, dtype=dtype)
    torch.library.opcheck(
        torch.ops.palestra.logprob_entropy.default, (logits.requires_grad_(True), tokens, 0.7, IGNORE)
    )
    _logp, ent, lse = torch.ops.palestra.logprob_entropy(logits.detach(), tokens, 0.7, IGNORE)
    torch.library.opcheck(
        torch.ops.palestra.logprob_entropy_backward.default,
        (torch.randn(7), torch.randn(7), logits.detach(), tokens, lse, ent, 0.7, IGNORE),
    )


def test_opcheck_triton():
    from palestra.kernels import triton_logprob_entropy  # noqa: F401

    logits, tokens = make_inputs((3,), 40)
    torch.library.opcheck(
        torch.ops.palestra_triton.logprob_entropy.default, (logits.requires_grad_(True), tokens, 0.7, IGNORE)
    )


@pytest.mark.slow
def test_torch_compile_fullgraph_cpp():
    torch._dynamo.reset()
    K.set_backend("cpp")
    try:

        def loss(x, tokens):
            logp, ent = K.logprob_entropy(x, tokens, 0.8)
            return (logp * 2.0 - 0.1 * ent).sum()

        compiled = torch.compile(loss, fullgraph=True)
        logits, tokens = make_inputs((2, 5), 300)
        x = logits.clone().requires_grad_(True)
        out = compiled(x, tokens)
        (grad,) = torch.autograd.grad(out, x)
        x_ref = logits.clone().requires_grad_(True)
        out_ref = loss(x_ref, tokens)
        (grad_ref,) = torch.autograd.grad(out_ref, x_ref)
        torch.testing.assert_close(out, out_ref)
        torch.testing.assert_close(grad, grad_ref)
    finally:
        K.set_backend(None)
        torch._dynamo.reset()


# ---- bad inputs: one-line errors naming the argument -------------------------------------------------
def _bad_cases():
    x = torch.randn(2, 3, 10)
    t = torch.randint(0, 10, (2, 3))
    return [
        ("shape", (x, t[:, :2]), {}, ValueError, r"tokens has shape \[2, 2\], expected logits.shape\[:-1\]"),
        ("token-dtype", (x, t.float()), {}, TypeError, "tokens has dtype float32"),
        ("token-high", (x, torch.where(t == t[0, 0], 10, t)), {}, ValueError, r"tokens contains 10.*V = 10"),
        ("token-negative", (x, torch.full((2, 3), -5)), {}, ValueError, r"tokens contains -5.*V = 10"),
        ("temperature-zero", (x, t), {"temperature": 0.0}, ValueError, "temperature"),
        ("temperature-negative", (x, t, -1.0), {}, ValueError, "temperature"),
        ("logits-dtype", (x.double(), t), {}, TypeError, "logits has dtype float64"),
        ("logits-int", (x.long(), t), {}, TypeError, "logits has dtype int64"),
        ("empty-vocab", (torch.randn(2, 3, 0), t), {}, ValueError, "logits has shape .*vocabulary"),
        ("not-a-tensor", ([1.0, 2.0], t), {}, TypeError, "logits must be a torch.Tensor"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_raise_one_line_errors(case):
    _, args, kwargs, exc, pattern = case
    with pytest.raises(exc, match=pattern) as info:
        K.logprob_entropy(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith("logprob_entropy:")


def test_native_kernel_rejects_bad_tokens_itself():
    """Under torch.compile the Python range check is skipped; the C++ op still refuses bad token ids."""
    CPU_LIBRARY.load()
    with pytest.raises(RuntimeError, match=r"tokens\[1\] = 10 is outside \[0, 10\)"):
        torch.ops.palestra.logprob_entropy(torch.randn(2, 10), torch.tensor([3, 10]), 1.0, IGNORE)


# ---- back-end choice ---------------------------------------------------------------------------------
def test_backend_forcing(monkeypatch):
    logits, tokens = make_inputs((3,), 100, ignored=0.0)
    x = logits.clone().requires_grad_(True)
    K.set_backend(None)
    results = {}
    # Which implementation ran shows in the autograd node that produced the outputs.
    expected_node = {
        "torch": "WhereBackward",
        "cpp": "palestra_logprob_entropy",
        "triton": "palestra_triton_logprob_entropy",
    }
    for name, node in expected_node.items():
        monkeypatch.setenv("PALESTRA_KERNELS", name)
        logp, ent = K.logprob_entropy(x, tokens)
        producer = logp.grad_fn
        while type(producer).__name__.startswith("ViewBackward"):  # the final reshape to tokens' shape
            producer = producer.next_functions[0][0]
        assert node in type(producer).__name__, (name, type(producer).__name__)
        results[name] = (logp, ent)
    for name in ("cpp", "triton"):
        torch.testing.assert_close(results[name], results["torch"], atol=1e-5, rtol=1e-5)
    monkeypatch.delenv("PALESTRA_KERNELS")
    assert LE._op.backend_for(x.device) == "cpp"  # automatic choice on CPU
    monkeypatch.setenv("PALESTRA_KERNELS", "cuda")  # forced but unable to serve a CPU tensor: an error
    with pytest.raises(KernelBuildError, match=r"logprob_entropy.*cuda"):
        K.logprob_entropy(logits, tokens)
    monkeypatch.delenv("PALESTRA_KERNELS")
    with pytest.raises(KernelBuildError, match=r"logprob_entropy.*cuda"):
        K.logprob_entropy(logits, tokens, backend="cuda")


# ---- the CUDA kernels, run on the host ---------------------------------------------------------------
# Just enough CUDA for logprob_entropy.cu: a block's threads are real threads, a warp shuffle is an exchange
# through a per-warp buffer between two barriers, __shared__ is static storage (blocks run one after
# another), bf16 / fp16 are 16-bit payloads converted with round-to-nearest-even. exp2f / logf are libm's
# (the GPU's are approximate to a few ulp).
_CUDA_ON_HOST = r"""
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMisalignedAddress = 716 };
typedef void* cudaStream_t;
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint4 __ldcs(const uint4* p) { return *p; }
inline void __stcs(uint4* p, uint4 v) { *p = v; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(unsigned(h.x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {uint16_t(0x7FC0)};
  return {uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

struct __half { _Float16 v; };
struct __half2 { __half x, y; };
struct float2 { float x, y; };
inline float __half2float(__half h) { return float(h.v); }
inline __half __float2half_rn(float f) { return {_Float16(f)}; }
inline float2 __half22float2(__half2 h) { return {float(h.x.v), float(h.y.v)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }

namespace host {
struct Warp { std::barrier<> bar{32}; alignas(8) unsigned char slot[32][8]; };
struct Block {
  std::barrier<> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  explicit Block(unsigned n) : bar(n) { for (unsigned w = 0; w < (n + 31) / 32; ++w) warps.emplace_back(new Warp); }
};
inline thread_local dim3 thread_idx, block_idx, block_dim;
inline thread_local Block* block = nullptr;
inline thread_local int lane = 0;

template <class T> T exchange(T v, int src) {
  Warp* w = block->warps[thread_idx.x / 32].get();
  std::memcpy(w->slot[lane], &v, sizeof(T));
  w->bar.arrive_and_wait();
  T out;
  std::memcpy(&out, w->slot[src], sizeof(T));
  w->bar.arrive_and_wait();
  return out;
}

template <class F> void launch(dim3 grid, dim3 dim, F body) {
  for (unsigned b = 0; b < grid.x; ++b) {
    Block blk(dim.x);
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < dim.x; ++t) {
      threads.emplace_back([&, t] {
        thread_idx = dim3(t); block_idx = dim3(b); block_dim = dim; block = &blk; lane = int(t % 32);
        body();
      });
    }
    for (auto& th : threads) th.join();
  }
}
}  // namespace host

#define threadIdx host::thread_idx
#define blockIdx host::block_idx
#define blockDim host::block_dim
template <class T> T __shfl_xor_sync(unsigned, T v, int mask) { return host::exchange(v, host::lane ^ mask); }
inline void __syncthreads() { host::block->bar.arrive_and_wait(); }
"""

_HOST_ENTRY_POINTS = r"""
#include "logprob_entropy_host.cpp"
using palestra::cuda::LogitsDType;
extern "C" int host_forward(const void* logits, int dtype, const int64_t* tokens, float* logp, float* entropy,
                            float* lse, int64_t N, int64_t V, float inv_t, int64_t ignore_index) {
  return palestra::cuda::launch_logprob_entropy_forward(logits, LogitsDType(dtype), tokens, logp, entropy, lse, N, V,
                                                        inv_t, ignore_index, nullptr);
}
extern "C" int host_backward(const float* g_logp, const float* g_ent, const void* logits, int dtype,
                             const int64_t* tokens, const float* lse, const float* entropy, void* grad, int64_t N,
                             int64_t V, float inv_t, int64_t ignore_index) {
  return palestra::cuda::launch_logprob_entropy_backward(g_logp, g_ent, logits, LogitsDType(dtype), tokens, lse,
                                                         entropy, grad, N, V, inv_t, ignore_index, nullptr);
}
"""

_LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^<>]*>)?)\s*<<<(.*?)>>>\s*\((.*?)\);", re.S)
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _build_cuda_on_host(out: Path) -> ctypes.CDLL:
    cu_dir = csrc_dir() / "cuda"
    (out / "cuda_runtime.h").write_text(_CUDA_ON_HOST)
    for header in ("cuda_bf16.h", "cuda_fp16.h"):
        (out / header).write_text('#include "cuda_runtime.h"\n')

    def host_launch(m: re.Match) -> str:
        grid, block = (s.strip() for s in m.group(2).split(",")[:2])
        return f"host::launch(dim3({grid}), dim3({block}), [&] {{ {m.group(1)}({m.group(3)}); }});"

    source, launches = _LAUNCH.subn(host_launch, (cu_dir / "logprob_entropy.cu").read_text())
    assert launches == 2, "logprob_entropy.cu: expected the forward and the backward launch"
    (out / "logprob_entropy_host.cpp").write_text(source)
    (out / "main.cpp").write_text(_HOST_ENTRY_POINTS)
    so = out / "logprob_entropy_host.so"
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
        str(out / "main.cpp"),
        "-o",
        str(so),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lib = ctypes.CDLL(str(so))
    P, I64, F, C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.host_forward.argtypes = [P, C, P, P, P, P, I64, I64, F, I64]
    lib.host_backward.argtypes = [P, P, P, C, P, P, P, P, I64, I64, F, I64]
    return lib


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
@pytest.mark.slow
def test_cuda_kernels_under_host_emulation(tmp_path):
    lib = _build_cuda_on_host(tmp_path)
    # V = 9001 fp32 / 17001 bf16 runs 512 threads through the unrolled main loop and the remainder loop;
    # V = 37 leaves most of a 32-thread block idle. A storage offset of one element misaligns the rows,
    # so the scalar head before the first 16-byte boundary is exercised too.
    cases = [(torch.float32, 9001, 0), (torch.bfloat16, 17001, 1), (torch.float16, 37, 1), (torch.float32, 300, 1)]
    for dtype, vocab, offset in cases:
        n_rows, temperature = 3, 0.8
        logits, tokens = make_inputs((n_rows,), vocab, dtype=dtype, ignored=0.0)
        tokens[1] = IGNORE
        storage = torch.empty(n_rows * vocab + offset, dtype=dtype)
        x = storage[offset:].view(n_rows, vocab)
        x.copy_(logits)
        logp, ent, lse = (torch.full((n_rows,), 7.0) for _ in range(3))
        rc = lib.host_forward(
            x.data_ptr(),
            _DTYPE_CODE[dtype],
            tokens.data_ptr(),
            logp.data_ptr(),
            ent.data_ptr(),
            lse.data_ptr(),
            n_rows,
            vocab,
            1.0 / temperature,
            IGNORE,
        )
        assert rc == 0
        x_ref = logits.double().requires_grad_(True)
        r_logp, r_ent = reference(x_ref, tokens, temperature)
        what = f"cuda(host) {dtype} V={vocab} offset={offset}"
        torch.testing.assert_close(logp.double(), r_logp.detach(), atol=2e-5, rtol=2e-5, msg=what)
        torch.testing.assert_close(ent.double(), r_ent.detach(), atol=2e-5, rtol=2e-5, msg=what)
        assert lse[1] == 0

        g_logp, g_ent = torch.randn(n_rows), torch.randn(n_rows)
        grad_storage = torch.full((n_rows * vocab + offset,), 7.0).to(dtype)
        grad = grad_storage[offset:].view(n_rows, vocab)
        rc = lib.host_backward(
            g_logp.data_ptr(),
            g_ent.data_ptr(),
            x.data_ptr(),
            _DTYPE_CODE[dtype],
            tokens.data_ptr(),
            lse.data_ptr(),
            ent.data_ptr(),
            grad.data_ptr(),
            n_rows,
            vocab,
            1.0 / temperature,
            IGNORE,
        )
        assert rc == 0
        (r_grad,) = torch.autograd.grad((r_logp, r_ent), x_ref, (g_logp.double(), g_ent.double()))
        eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-4
        torch.testing.assert_close(grad.double(), r_grad, atol=1e-6, rtol=eps, msg=what)
        assert (grad[1] == 0).all()
