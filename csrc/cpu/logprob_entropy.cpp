// CPU kernels for palestra::logprob_entropy and palestra::logprob_entropy_backward.
//
// Forward: one pass over each row of logits [N, V]. The row is streamed in blocks of kBlock columns
// (small enough to stay in L1): a first sweep over the block finds its max, a second sweep (from L1)
// accumulates s = sum exp(z - m) and t = sum exp(z - m) * (z - m) against the running max m (rescaled
// when a block raises it). Keeping t relative to m (rather than sum exp(z - m) * z) avoids cancelling
// two large numbers when the logits sit far from zero: lse = m + log s and entropy = log s - t / s.
// Nothing of size [N, V] is allocated; rows are split between threads with at::parallel_for.
//
// Backward: p = exp(z - lse) is recomputed from the saved lse, and the gradient is written once:
//   dz_j = g_logp * (1[j == tok] - p_j) - g_ent * p_j * (z_j - lse + H),   dlogits = dz / temperature.
//
// exp runs in base 2 (2^y = 2^n * poly(f)). Two versions of the inner loops: AVX-512 intrinsics
// (roundscale / scalef, and a software prefetch of the next block so that memory traffic overlaps the
// arithmetic), used when the compiler targets AVX-512 (-march=native here), and portable loops that GCC
// vectorises through `#pragma omp simd` on any other CPU (PALESTRA_CPU_PORTABLE=1 forces them, so the
// tests cover both). libm's expf would keep the loops scalar. bf16 / fp16 blocks are widened to fp32 in
// an L1-resident scratch buffer; all arithmetic is fp32.
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

#if defined(__AVX512F__) || defined(__F16C__) || defined(__SSE__)
#include <immintrin.h>
#endif

namespace palestra {
namespace {

// 2048 fp32 columns = 8 KiB: a block and its scratch copy fit in L1 together.
constexpr int64_t kBlock = 2048;

// Everything runs in base 2: y = (z - m) * log2(e), 2^y = 2^n * 2^f with n = round(y), |f| <= 1/2.
// y is clamped to [kExp2Lo, kExp2Hi]: 2^kExp2Lo is the smallest normal float, so masked logits (-inf)
// contribute a harmless ~1e-38 instead of 0 * inf = NaN in t, and kExp2Hi keeps 2^n finite.
constexpr float kExp2Lo = -126.0f;
constexpr float kExp2Hi = 127.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.69314718055994531f;
// 1.5 * 2^23 + 127: adding it rounds y to an integer n and leaves n + 127 (the biased exponent of 2^n)
// in the low mantissa bits, so `bits << 23` is 2^n without a float -> int conversion.
constexpr float kRoundBias = 12582912.0f + 127.0f;

__attribute__((always_inline)) inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

__attribute__((always_inline)) inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// 2^y for y already clamped to [kExp2Lo, kExp2Hi]; degree-6 polynomial fitted (relative error, p(0) = 1)
// to 2^f on [-1/2, 1/2]: under 1e-7 relative error in fp32.
__attribute__((always_inline)) inline float exp2_unchecked(float y) {
  const float k = y + kRoundBias;
  const float f = y - (k - kRoundBias);
  float p = 1.5353360504377633e-4f;
  p = std::fma(p, f, 1.3398875016719103e-3f);
  p = std::fma(p, f, 9.61843691766262e-3f);
  p = std::fma(p, f, 5.5503323674201965e-2f);
  p = std::fma(p, f, 2.4022647738456726e-1f);
  p = std::fma(p, f, 6.931471824645996e-1f);
  p = std::fma(p, f, 1.0f);
  return p * bits_to_float(float_to_bits(k) << 23);
}

__attribute__((always_inline)) inline float clamp_exp2_arg(float y) {
  y = y < kExp2Lo ? kExp2Lo : y;
  return y > kExp2Hi ? kExp2Hi : y;
}

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
  float max;      // row max of the logits (not divided by the temperature)
  float log_s;    // ln sum exp(z - max / T): lse = max / T + log_s
  float entropy;
};

// s += sum 2^y and t2 += sum 2^y * y over one block, y = (x - mx) * c2 with c2 = log2(e) / temperature
// (so y <= 0 against the running max mx; only the lower clamp can bite).
inline void block_sums_portable(const float* x, int64_t n, float mx, float c2, float& s, float& t2) {
  float bs = 0.f, bt = 0.f;
#pragma omp simd reduction(+ : bs, bt)
  for (int64_t j = 0; j < n; ++j) {
    float y = (x[j] - mx) * c2;  // x - mx is exact near the max, where the mass is
    y = y < kExp2Lo ? kExp2Lo : y;
    const float e = exp2_unchecked(y);
    bs += e;
    bt = std::fma(e, y, bt);
  }
  s += bs;
  t2 += bt;
}

#if defined(__AVX512F__)
// The same with AVX-512 intrinsics: roundscale and scalef replace the rounding and exponent tricks
// (2^y = scalef(p(f), n)), which takes the loop from ~22 to ~14 instructions per 16 columns.
// y >= -126 after the clamp, so n >= -126 and f >= 0 when n = -126: results stay normal floats.
struct Exp2x16 {
  const __m512 c1 = _mm512_set1_ps(6.931471824645996e-1f), c2 = _mm512_set1_ps(2.4022647738456726e-1f),
               c3 = _mm512_set1_ps(5.5503323674201965e-2f), c4 = _mm512_set1_ps(9.61843691766262e-3f),
               c5 = _mm512_set1_ps(1.3398875016719103e-3f), c6 = _mm512_set1_ps(1.5353360504377633e-4f),
               one = _mm512_set1_ps(1.0f);

  __attribute__((always_inline)) __m512 operator()(__m512 y) const {
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_fmadd_ps(c6, f, c5);
    p = _mm512_fmadd_ps(p, f, c4);
    p = _mm512_fmadd_ps(p, f, c3);
    p = _mm512_fmadd_ps(p, f, c2);
    p = _mm512_fmadd_ps(p, f, c1);
    p = _mm512_fmadd_ps(p, f, one);
    return _mm512_scalef_ps(p, n);
  }
};

// `prefetch` (bytes, may be null): the next block of this thread's rows, pulled into L1 one or two
// cache lines per iteration while this block is computed, so memory and arithmetic overlap.
inline void block_sums_avx512(const float* x, int64_t n, float mx, float c2, float& s, float& t2,
                              const char* prefetch, int64_t prefetch_bytes) {
  const Exp2x16 exp2;
  const __m512 vmx = _mm512_set1_ps(mx), vc2 = _mm512_set1_ps(c2), lo = _mm512_set1_ps(kExp2Lo);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
  // max(lo, y) keeps a NaN y (the second operand wins), so NaN logits give NaN results.
  auto y_of = [&](__m512 v) { return _mm512_max_ps(lo, _mm512_mul_ps(_mm512_sub_ps(v, vmx), vc2)); };
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    if (prefetch != nullptr) {
      const int64_t at = j * prefetch_bytes / n;  // spread the next block's lines over this loop
      _mm_prefetch(prefetch + at, _MM_HINT_T0);
      _mm_prefetch(prefetch + at + 64, _MM_HINT_T0);
    }
    const __m512 y0 = y_of(_mm512_loadu_ps(x + j)), y1 = y_of(_mm512_loadu_ps(x + j + 16));
    const __m512 e0 = exp2(y0), e1 = exp2(y1);
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
    t0 = _mm512_fmadd_ps(e0, y0, t0);
    t1 = _mm512_fmadd_ps(e1, y1, t1);
  }
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
    // Lanes past the end add nothing (y and e zeroed: their y could be +inf when mx is still lowest).
    const __m512 y = _mm512_maskz_mov_ps(m, y_of(_mm512_maskz_loadu_ps(m, x + j)));
    const __m512 e = _mm512_maskz_mov_ps(m, exp2(y));
    s0 = _mm512_add_ps(s0, e);
    t0 = _mm512_fmadd_ps(e, y, t0);
  }
  s += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  t2 += _mm512_reduce_add_ps(_mm512_add_ps(t0, t1));
}
#endif

// The portable loops are what other CPUs compile; PALESTRA_CPU_PORTABLE=1 selects them here too (the
// tests run both).
inline bool use_avx512() {
#if defined(__AVX512F__)
  const char* env = std::getenv("PALESTRA_CPU_PORTABLE");
  return env == nullptr || std::strcmp(env, "1") != 0;
#else
  return false;
#endif
}

// Move the accumulators from running max `mx` to `new_mx` (both in logit units):
// sum e'y' = alpha * (sum e y + d * sum e) with d = (mx - new_mx) * c2 and alpha = 2^d.
inline void rescale(float& s, float& t2, float mx, float new_mx, float c2) {
  if (s > 0.f) {
    const float d = clamp_exp2_arg((mx - new_mx) * c2);
    const float alpha = exp2_unchecked(d);
    t2 = alpha * std::fma(d, s, t2);
    s *= alpha;
  }
}

template <typename T>
RowStats row_forward(const T* x, int64_t V, float inv_t, float* scratch, [[maybe_unused]] bool avx512) {
  // The lowest finite float, not -inf, so that a leading block of -inf logits gives finite gaps.
  float mx = std::numeric_limits<float>::lowest();
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
    const float bm = max_of(xb, n);
    if (bm > mx) {
      rescale(s, t2, mx, bm, c2);
      mx = bm;
    }
#if defined(__AVX512F__)
    if (avx512) {
      // The bytes after this block are the next block of this row, or the start of the next row.
      const char* next = reinterpret_cast<const char*>(x + b + n);
      block_sums_avx512(xb, n, mx, c2, s, t2, next, static_cast<int64_t>(std::min(kBlock, V) * sizeof(T)));
      continue;
    }
#endif
    block_sums_portable(xb, n, mx, c2, s, t2);
  }
  // lse = m + ln s; entropy = lse - E[z] = ln s - E[z - m] = ln s - ln2 * t2 / s.
  const float log_s = std::log(s);
  return {mx, log_s, std::max(std::fma(-kLn2, t2 / s, log_s), 0.f)};
}

// out[j] = 2^y_j * (a + c * y_j), y_j = clamp(x_j / T - lse) * log2(e), for one block.
inline void backward_block_portable(const float* x, float* out, int64_t n, float inv_t, float lse, float a, float c) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    // z - lse <= 0 up to rounding; the upper clamp only guards against an inconsistent lse.
    const float y = clamp_exp2_arg(std::fma(x[j], inv_t, -lse) * kLog2e);
    out[j] = exp2_unchecked(y) * std::fma(c, y, a);
  }
}

#if defined(__AVX512F__)
// The AVX-512 version also adds the token's term (tok_local = tok - block start; any value if the token
// is elsewhere) before storing, so that each gradient element is written exactly once. With `stream`
// (fp32 output, 64-byte aligned) full vectors go out as non-temporal stores: the [N, V] gradient is not
// read back soon, and streaming it skips reading every destination line into the cache first.
inline void backward_block_avx512(const float* x, float* out, int64_t n, float inv_t, float lse, float a, float c,
                                  int64_t tok_local, float tok_term, bool stream) {
  const Exp2x16 exp2;
  const __m512 vinv = _mm512_set1_ps(inv_t), vlse = _mm512_set1_ps(lse), vlog2e = _mm512_set1_ps(kLog2e);
  const __m512 lo = _mm512_set1_ps(kExp2Lo), hi = _mm512_set1_ps(kExp2Hi);
  const __m512 va = _mm512_set1_ps(a), vc = _mm512_set1_ps(c), vtok = _mm512_set1_ps(tok_term);
  for (int64_t j = 0; j < n; j += 16) {
    const bool full = n - j >= 16;
    const __mmask16 m = full ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 x16 = _mm512_maskz_loadu_ps(m, x + j);
    __m512 y = _mm512_mul_ps(_mm512_fmsub_ps(x16, vinv, vlse), vlog2e);
    y = _mm512_min_ps(hi, _mm512_max_ps(lo, y));
    __m512 g = _mm512_mul_ps(exp2(y), _mm512_fmadd_ps(vc, y, va));
    if (static_cast<uint64_t>(tok_local - j) < 16) {
      g = _mm512_mask_add_ps(g, static_cast<__mmask16>(1u << (tok_local - j)), g, vtok);
    }
    if (full && stream) {
      _mm512_stream_ps(out + j, g);
    } else {
      _mm512_mask_storeu_ps(out + j, m, g);
    }
  }
}
#endif

template <typename T>
void row_backward(const T* x, T* gx, int64_t V, int64_t tok, float g_logp, float g_ent, float lse, float ent,
                  float inv_t, float* scratch, [[maybe_unused]] bool avx512) {
  // dlogits_j = -inv_t * p_j * (g_logp + g_ent * (z_j - lse + H)) + inv_t * g_logp * 1[j == tok]
  //          = p_j * (a + c * y_j) + ...,  y_j = (z_j - lse) * log2(e),  p_j = 2^y_j.
  const float a = -inv_t * std::fma(g_ent, ent, g_logp);  // -inv_t * (g_logp + g_ent * H)
  const float c = -inv_t * g_ent * kLn2;

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
#if defined(__AVX512F__)
    if (avx512) {
      const bool stream = std::is_same_v<T, float> && (reinterpret_cast<uintptr_t>(out) & 63u) == 0;
      backward_block_avx512(xb, out, n, inv_t, lse, a, c, tok - b, inv_t * g_logp, stream);
    } else {
      backward_block_portable(xb, out, n, inv_t, lse, a, c);
      if (tok >= b && tok < b + n) out[tok - b] += inv_t * g_logp;
    }
#else
    backward_block_portable(xb, out, n, inv_t, lse, a, c);
    if (tok >= b && tok < b + n) out[tok - b] += inv_t * g_logp;
#endif
    if constexpr (!std::is_same_v<T, float>) narrow(scratch, gx + b, n);
  }
#if defined(__AVX512F__)
  if (avx512) _mm_sfence();  // order the non-temporal stores before the op returns
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

  const bool avx512 = use_avx512();
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
        const RowStats st = row_forward(row, V, inv_t, scratch, avx512);
        lse_p[i] = std::fma(st.max, inv_t, st.log_s);
        ent_p[i] = st.entropy;
        // z_tok - lse as (x_tok - max) / T - log_s: no cancellation between two large numbers.
        logp_p[i] = std::min((to_float(row[tok[i]]) - st.max) * inv_t - st.log_s, 0.f);
      }
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
  const float inv_t = static_cast<float>(1.0 / temperature);
  const float* gl = g_logp.data_ptr<float>();
  const float* ge = g_ent.data_ptr<float>();
  const float* lse_p = lse.data_ptr<float>();
  const float* ent_p = ent.data_ptr<float>();

  const bool avx512 = use_avx512();
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
        row_backward(x + i * V, out, V, tok[i], gl[i], ge[i], lse_p[i], ent_p[i], inv_t, scratch, avx512);
      }
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
