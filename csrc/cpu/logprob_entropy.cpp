// CPU kernels for palestra::logprob_entropy and palestra::logprob_entropy_backward.
//
// Forward: one pass over each row of logits [N, V]. The row is streamed in blocks of kBlock columns
// (small enough to stay in L1): a first sweep over the block finds its max, a second sweep (from L1)
// accumulates s = sum exp(z - m) and t = sum exp(z - m) * (z - m) against the running max m (rescaled
// when a block raises it). Keeping t relative to m (rather than sum exp(z - m) * z) avoids cancelling
// two large numbers when the logits sit far from zero: lse = m + log s and entropy = log s - t / s.
// In base 2, m is held as m2 = max * log2(e) / T (rounded once), and y = x * c2 - m2 is one fused
// multiply-add: exact up to its single rounding, and the same offset for the whole row, so lse =
// (m2 + log2 s) * ln 2 stays consistent with it.
// Nothing of size [N, V] is allocated; rows are split between threads with at::parallel_for.
//
// Backward: p = exp(z - lse) is recomputed from the saved lse, and the gradient is written once:
//   dz_j = g_logp * (1[j == tok] - p_j) - g_ent * p_j * (z_j - lse + H),   dlogits = dz / temperature.
//
// exp runs in base 2 (2^y = 2^n * poly(f), simd.h). The inner loops are templates over simd.h's lane
// types, compiled for AVX-512, AVX2 + FMA or portable vector extensions, whichever is widest on the host
// (-march=native); PALESTRA_CPU_PORTABLE=1 forces the portable lanes, so the tests cover them on every
// machine. The forward software-prefetches the next block so that memory traffic overlaps the
// arithmetic. libm's expf would keep the loops scalar. bf16 / fp16 blocks are widened to fp32 in an
// L1-resident scratch buffer; all arithmetic is fp32.
//
// The [N, V] gradient is the one large allocation: its pages are advised as transparent huge pages
// before the first write, because first-touching 512 MiB in 4 KiB pages costs more than the backward
// arithmetic (see advise_huge_pages).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "cpu/simd.h"

// The lane types' vectors are passed between inlined functions of this file only (see simd.h).
#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__AVX512F__) || defined(__F16C__) || defined(__SSE__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace palestra {
namespace {

// 2048 fp32 columns = 8 KiB: a block and its scratch copy fit in L1 together.
constexpr int64_t kBlock = 2048;

using simd::bits_to_float;
using simd::clamp_exp2_arg;
using simd::exp2_unchecked;
using simd::float_to_bits;
using simd::kExp2Hi;
using simd::kExp2Lo;
using simd::kLn2;
using simd::kLog2e;

// ---- dtype conversions (widen on load, round-to-nearest-even on store) ---------------------------

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// Calls f(T{}) with T the C++ type of a float32 / bfloat16 / float16 tensor.
template <typename F>
void dispatch_logits_dtype(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default:
      TORCH_CHECK(false, "palestra::logprob_entropy: logits dtype must be float32, bfloat16 or float16, got ", st);
  }
}

// Widen n elements of src into dst (fp32).
inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = bits_to_float(static_cast<uint32_t>(src[j].x) << 16);
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j))));
  }
#elif defined(__F16C__)
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
  }
#endif
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

inline float max_of(const float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

inline void narrow(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void narrow(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = float_to_bits(src[j]);
    const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    const bool is_nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
    out[j] = is_nan ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
  }
}

inline void narrow(const float* src, c10::Half* dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#elif defined(__F16C__)
  for (; j + 8 <= n; j += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; j < n; ++j) dst[j] = c10::Half(src[j]);
}

// ---- per-row kernels -----------------------------------------------------------------------------

struct RowStats {
  float max2;     // the row max in base-2 units: max * log2(e) / T, rounded
  float log_s;    // ln sum 2^(x * c2 - max2): lse = max2 * ln 2 + log_s
  float entropy;
};

// s += sum 2^y and t2 += sum 2^y * y over one block, y = x * c2 - m2 with c2 = log2(e) / temperature
// (so y <= 0 against the running max m2, up to rounding; only the lower clamp can bite). `prefetch` (may be null): the
// next block of this thread's rows, pulled into L1 two cache lines per 32 columns while this block is
// computed. The last n % (2 * width) columns go through the scalar formula.
template <class L>
void block_sums(const float* x, int64_t n, float m2, float c2, float& s, float& t2, const char* prefetch,
                int64_t prefetch_bytes) {
  using V = typename L::V;
  constexpr int64_t W = L::kWidth;
  const V neg_m2 = L::set1(-m2), vc2 = L::set1(c2), lo = L::set1(kExp2Lo);
  V s0 = L::zero(), s1 = L::zero(), u0 = L::zero(), u1 = L::zero();
  // Spread the next block's lines over this loop: `step` bytes further every 32 columns (no division in
  // the loop: a 64-bit divide there costs more than the prefetch saves).
  const int64_t step = prefetch_bytes * 32 / n;
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    if (prefetch != nullptr && j % 32 == 0) {
      const char* at = prefetch + (j / 32) * step;
      __builtin_prefetch(at, 0, 3);
      __builtin_prefetch(at + 64, 0, 3);
    }
    const V y0 = L::max_keep_nan(lo, L::fmadd(L::load(x + j), vc2, neg_m2));
    const V y1 = L::max_keep_nan(lo, L::fmadd(L::load(x + j + W), vc2, neg_m2));
    const V e0 = L::exp2(y0), e1 = L::exp2(y1);
    s0 = L::add(s0, e0);
    s1 = L::add(s1, e1);
    u0 = L::fmadd(e0, y0, u0);
    u1 = L::fmadd(e1, y1, u1);
  }
  float bs = L::sum(L::add(s0, s1)), bt = L::sum(L::add(u0, u1));
  for (; j < n; ++j) {
    float y = std::fma(x[j], c2, -m2);
    y = y < kExp2Lo ? kExp2Lo : y;  // keeps a NaN y
    const float e = exp2_unchecked(y);
    bs += e;
    bt = std::fma(e, y, bt);
  }
  s += bs;
  t2 += bt;
}

// Move the accumulators from running max `m2` to `new_m2` (both in base-2 units):
// sum e'y' = alpha * (sum e y + d * sum e) with d = m2 - new_m2 and alpha = 2^d.
inline void rescale(float& s, float& t2, float m2, float new_m2) {
  if (s > 0.f) {
    const float d = clamp_exp2_arg(m2 - new_m2);
    const float alpha = exp2_unchecked(d);
    t2 = alpha * std::fma(d, s, t2);
    s *= alpha;
  }
}

template <class L, typename T>
RowStats row_forward(const T* x, int64_t V, float inv_t, float* scratch) {
  // The lowest finite float, not -inf, so that a leading block of -inf logits gives finite gaps.
  float m2 = std::numeric_limits<float>::lowest();
  const float c2 = inv_t * kLog2e;
  float s = 0.f, t2 = 0.f;
  for (int64_t b = 0; b < V; b += kBlock) {
    const int64_t n = std::min(kBlock, V - b);
    const float* xb;
    if constexpr (std::is_same_v<T, float>) {
      xb = x + b;
    } else {
      widen(x + b, scratch, n);
      xb = scratch;
    }
    const float bm2 = max_of(xb, n) * c2;  // -inf for a block of -inf logits: no change
    if (bm2 > m2) {
      rescale(s, t2, m2, bm2);
      m2 = bm2;
    }
    // The bytes after this block are the next block of this row, or the start of the next row.
    block_sums<L>(xb, n, m2, c2, s, t2, reinterpret_cast<const char*>(x + b + n),
                  static_cast<int64_t>(std::min(kBlock, V) * sizeof(T)));
  }
  // lse = m2 ln 2 + ln s; entropy = lse - E[z] = ln s - E[z - m] = ln s - ln2 * t2 / s.
  const float log_s = std::log(s);
  return {m2, log_s, std::max(std::fma(-kLn2, t2 / s, log_s), 0.f)};
}

// out[j] = 2^y_j * (a + c * y_j) + tok_term * 1[j == tok_local], y_j = clamp(x_j / T - lse) * log2(e),
// for one block (tok_local = tok - block start: any value if the token is elsewhere). The token's term is
// added in registers, so each gradient element is written exactly once. With `stream` (fp32 output
// aligned for the lane type), full vectors go out as non-temporal stores: the [N, V] gradient is not read
// back soon, and streaming it skips reading every destination line into the cache first.
template <class L>
void backward_block(const float* x, float* out, int64_t n, float inv_t, float lse, float a, float c,
                    int64_t tok_local, float tok_term, bool stream) {
  using V = typename L::V;
  constexpr int64_t W = L::kWidth;
  const V vinv = L::set1(inv_t), vlse = L::set1(lse), vlog2e = L::set1(kLog2e);
  const V lo = L::set1(kExp2Lo), hi = L::set1(kExp2Hi), va = L::set1(a), vc = L::set1(c);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    // z - lse <= 0 up to rounding; the upper clamp only guards against an inconsistent lse.
    V y = L::mul(L::sub(L::mul(L::load(x + j), vinv), vlse), vlog2e);
    y = L::min_keep_nan(hi, L::max_keep_nan(lo, y));
    V g = L::mul(L::exp2(y), L::fmadd(vc, y, va));
    if (static_cast<uint64_t>(tok_local - j) < static_cast<uint64_t>(W)) {
      g = L::add_at_lane(g, static_cast<int>(tok_local - j), tok_term);
    }
    if (stream) {
      L::stream(out + j, g);
    } else {
      L::store(out + j, g);
    }
  }
  for (; j < n; ++j) {
    const float y = clamp_exp2_arg(std::fma(x[j], inv_t, -lse) * kLog2e);
    out[j] = exp2_unchecked(y) * std::fma(c, y, a) + (j == tok_local ? tok_term : 0.f);
  }
}

template <class L, typename T>
void row_backward(const T* x, T* gx, int64_t V, int64_t tok, float g_logp, float g_ent, float lse, float ent,
                  float inv_t, float* scratch) {
  // dlogits_j = -inv_t * p_j * (g_logp + g_ent * (z_j - lse + H)) + inv_t * g_logp * 1[j == tok]
  //          = p_j * (a + c * y_j) + ...,  y_j = (z_j - lse) * log2(e),  p_j = 2^y_j.
  const float a = -inv_t * std::fma(g_ent, ent, g_logp);  // -inv_t * (g_logp + g_ent * H)
  const float c = -inv_t * g_ent * kLn2;
  bool streamed = false;
  for (int64_t b = 0; b < V; b += kBlock) {
    const int64_t n = std::min(kBlock, V - b);
    const float* xb;
    float* out;
    if constexpr (std::is_same_v<T, float>) {
      xb = x + b;
      out = gx + b;
    } else {
      widen(x + b, scratch, n);  // computed in place, then narrowed into gx
      xb = out = scratch;
    }
    const bool stream = std::is_same_v<T, float> && L::kStreamAlign != 0 &&
                        (reinterpret_cast<uintptr_t>(out) & (L::kStreamAlign - 1)) == 0;
    streamed = streamed || stream;
    backward_block<L>(xb, out, n, inv_t, lse, a, c, tok - b, inv_t * g_logp, stream);
    if constexpr (!std::is_same_v<T, float>) narrow(scratch, gx + b, n);
  }
#if defined(__SSE__)
  if (streamed) _mm_sfence();  // order the non-temporal stores before the op returns
#endif
}

// ---- the gradient's memory ---------------------------------------------------------------------------

// Ask the kernel to back the whole pages of [p, p + bytes) with transparent huge pages, before anything
// writes them. A fresh 512 MiB gradient in 4 KiB pages is 131072 page faults, about 0.25 s on a 2-core
// VM: several times the backward's arithmetic. In 2 MiB pages it is 256. Advice only: where THP is off
// ("never"), on pages already touched (memory the allocator reused), or off Linux, nothing changes.
// torch does the same for every allocation when THP_MEM_ALLOC_ENABLE=1; here it is only this buffer.
void advise_huge_pages([[maybe_unused]] void* p, [[maybe_unused]] size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHugePage = size_t{2} << 20;
  if (bytes < 4 * kHugePage) return;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

// ---- op entry points -------------------------------------------------------------------------------

void check_common(const at::Tensor& logits, const at::Tensor& tokens, double temperature) {
  TORCH_CHECK(logits.dim() == 2, "palestra::logprob_entropy: logits must be 2-D [N, V], got ", logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              "palestra::logprob_entropy: logits dtype must be float32, bfloat16 or float16, got ",
              logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0, "palestra::logprob_entropy: logits has an empty vocabulary (V = 0)");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == logits.size(0), "palestra::logprob_entropy: tokens must be [",
              logits.size(0), "], got ", tokens.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kLong, "palestra::logprob_entropy: tokens must be int64, got ",
              tokens.scalar_type());
  TORCH_CHECK(temperature > 0.0, "palestra::logprob_entropy: temperature must be > 0, got ", temperature);
}

// The token ids index memory directly, so a bad id is an error here even if the Python checks were skipped.
void check_token_range(const int64_t* tok, int64_t N, int64_t V, int64_t ignore_index) {
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(tok[i] == ignore_index || (tok[i] >= 0 && tok[i] < V), "palestra::logprob_entropy: tokens[", i,
                "] = ", tok[i], " is outside [0, ", V, ") and is not ignore_index (", ignore_index, ")");
  }
}

int64_t rows_per_task(int64_t V) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / V); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> logprob_entropy_cpu(const at::Tensor& logits_in,
                                                                   const at::Tensor& tokens_in, double temperature,
                                                                   int64_t ignore_index) {
  check_common(logits_in, tokens_in, temperature);
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor tokens = tokens_in.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty({N}, opts), ent = at::empty({N}, opts), lse = at::empty({N}, opts);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  check_token_range(tok, N, V, ignore_index);
  const float inv_t = static_cast<float>(1.0 / temperature);
  float* logp_p = logp.data_ptr<float>();
  float* ent_p = ent.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();

  const float c2 = inv_t * kLog2e;
  // The lane type and the dtype are chosen once per call, outside the row loop.
  simd::with_lanes(simd::level(), [&](auto lanes) {
    using L = decltype(lanes);
    dispatch_logits_dtype(logits.scalar_type(), [&](auto tag) {
      using scalar_t = decltype(tag);
      const scalar_t* x = static_cast<const scalar_t*>(logits.const_data_ptr());
      at::parallel_for(0, N, rows_per_task(V), [&](int64_t begin, int64_t end) {
        alignas(64) float scratch[kBlock];
        for (int64_t i = begin; i < end; ++i) {
          if (tok[i] == ignore_index) {  // ignored rows are not read at all
            logp_p[i] = ent_p[i] = lse_p[i] = 0.f;
            continue;
          }
          const scalar_t* row = x + i * V;
          const RowStats st = row_forward<L>(row, V, inv_t, scratch);
          lse_p[i] = std::fma(st.max2, kLn2, st.log_s);
          ent_p[i] = st.entropy;
          // z_tok - lse as (x_tok * c2 - max2) * ln 2 - log_s: the fused difference does not cancel two
          // rounded large numbers.
          logp_p[i] = std::min(std::fma(to_float(row[tok[i]]), c2, -st.max2) * kLn2 - st.log_s, 0.f);
        }
      });
    });
  });
  return {logp, ent, lse};
}

at::Tensor logprob_entropy_backward_cpu(const at::Tensor& grad_logp_in, const at::Tensor& grad_ent_in,
                                        const at::Tensor& logits_in, const at::Tensor& tokens_in,
                                        const at::Tensor& lse_in, const at::Tensor& ent_in, double temperature,
                                        int64_t ignore_index) {
  check_common(logits_in, tokens_in, temperature);
  const int64_t N = logits_in.size(0), V = logits_in.size(1);
  auto as_row_f32 = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.numel() == N, "palestra::logprob_entropy_backward: ", name, " must have ", N, " elements, got ",
                t.sizes());
    return t.reshape({N}).to(at::kFloat).contiguous();
  };
  const at::Tensor g_logp = as_row_f32(grad_logp_in, "grad_logp");
  const at::Tensor g_ent = as_row_f32(grad_ent_in, "grad_entropy");
  const at::Tensor lse = as_row_f32(lse_in, "lse");
  const at::Tensor ent = as_row_f32(ent_in, "entropy");
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor tokens = tokens_in.contiguous();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  check_token_range(tok, N, V, ignore_index);
  at::Tensor grad = at::empty_like(logits);
  advise_huge_pages(grad.mutable_data_ptr(), grad.nbytes());
  const float inv_t = static_cast<float>(1.0 / temperature);
  const float* gl = g_logp.data_ptr<float>();
  const float* ge = g_ent.data_ptr<float>();
  const float* lse_p = lse.data_ptr<float>();
  const float* ent_p = ent.data_ptr<float>();

  simd::with_lanes(simd::level(), [&](auto lanes) {
    using L = decltype(lanes);
    dispatch_logits_dtype(logits.scalar_type(), [&](auto tag) {
      using scalar_t = decltype(tag);
      const scalar_t* x = static_cast<const scalar_t*>(logits.const_data_ptr());
      scalar_t* gx = static_cast<scalar_t*>(grad.mutable_data_ptr());
      at::parallel_for(0, N, rows_per_task(V), [&](int64_t begin, int64_t end) {
        alignas(64) float scratch[kBlock];
        for (int64_t i = begin; i < end; ++i) {
          scalar_t* out = gx + i * V;
          if (tok[i] == ignore_index) {
            std::memset(static_cast<void*>(out), 0, V * sizeof(scalar_t));
            continue;
          }
          row_backward<L>(x + i * V, out, V, tok[i], gl[i], ge[i], lse_p[i], ent_p[i], inv_t, scratch);
        }
      });
    });
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(palestra, CPU, m) {
  m.impl("logprob_entropy", &logprob_entropy_cpu);
  m.impl("logprob_entropy_backward", &logprob_entropy_backward_cpu);
}

}  // namespace palestra
