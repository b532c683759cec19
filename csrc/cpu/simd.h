// Lanes of fp32 for the CPU kernels' inner loops, and the base-2 exponential they share.
//
// Three lane types with one interface, so that each loop is written once (as a template) and compiled
// for the widest one the compiler targets (-march=native):
//   Avx512Lanes    16 lanes, AVX-512F intrinsics (roundscale / scalef build 2^n);
//   Avx2Lanes       8 lanes, AVX2 + FMA intrinsics (2^n built with integer shifts);
//   PortableLanes   8 lanes, GCC / Clang vector extensions: the compiler lowers them to whatever the
//                   target has (one AVX register, two SSE or NEON registers).
// Plain loops with `#pragma omp simd` are not a substitute for the portable lanes: GCC 12 if-converts the
// exponent clamp into a branch and leaves such a loop scalar, 10x slower.
//
// 2^y = 2^n * p(f) with n = round(y), f = y - n in [-1/2, 1/2], p a degree-5 polynomial fitted to 2^f
// (minimax in relative error, p(0) = 1): 9e-8 relative error, 1.7e-7 with fp32 rounding. Degree 6 would
// add nothing fp32 can hold and one fused multiply-add to every element of the CPU's busiest loop. Callers clamp y to [kExp2Lo, kExp2Hi]
// first; the lane types' clamps keep NaN lanes NaN, so NaN inputs give NaN outputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// (-Wpsabi would note that 32-byte vector returns change ABI without AVX: everything here is inlined
// into its one translation unit, so no call crosses an ABI boundary.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace palestra {
namespace simd {

// 2^kExp2Lo is the smallest normal float: clamped (masked, -inf) logits contribute a harmless ~1e-38
// instead of 0 * inf = NaN, and kExp2Hi keeps 2^n finite.
constexpr float kExp2Lo = -126.0f;
constexpr float kExp2Hi = 127.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.69314718055994531f;
// 1.5 * 2^23 + 127: adding it rounds y to an integer n and leaves n + 127 (the biased exponent of 2^n)
// in the low mantissa bits, so `bits << 23` is 2^n without a float -> int conversion.
constexpr float kRoundBias = 12582912.0f + 127.0f;
// p(f) = sum kPoly[i] * f^i.
constexpr float kPoly[6] = {1.0f, 0.6931470036506653f, 0.24022242426872253f, 0.05550733581185341f,
                            0.009671504609286785f, 0.0013264701701700687f};

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

// Horner's rule for kPoly on any lane type L (or on float, with L = ScalarOps).
template <class L, class V>
__attribute__((always_inline)) inline V exp2_poly(V f) {
  V p = L::fmadd(L::set1(kPoly[5]), f, L::set1(kPoly[4]));
  for (int i = 3; i >= 0; --i) p = L::fmadd(p, f, L::set1(kPoly[i]));
  return p;
}

struct ScalarOps {
  static float set1(float x) { return x; }
  static float fmadd(float a, float b, float c) { return std::fma(a, b, c); }
};

// 2^y for one float already clamped to [kExp2Lo, kExp2Hi]: the tails of every loop.
__attribute__((always_inline)) inline float exp2_unchecked(float y) {
  const float k = y + kRoundBias;
  const float f = y - (k - kRoundBias);
  return exp2_poly<ScalarOps>(f) * bits_to_float(float_to_bits(k) << 23);
}

__attribute__((always_inline)) inline float clamp_exp2_arg(float y) {
  y = y < kExp2Lo ? kExp2Lo : y;  // keeps a NaN y
  return y > kExp2Hi ? kExp2Hi : y;
}

// ---- lane types -------------------------------------------------------------------------------------
// Each has: V, kWidth, kStreamAlign (bytes a non-temporal store needs), load, store, stream, set1, zero,
// add, sub, mul, fmadd, max_keep_nan(lo, y), min_keep_nan(hi, y), exp2 (of clamped lanes), sum (of the
// lanes), add_at_lane (v[lane] += x).

#if defined(__AVX512F__)
struct Avx512Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static constexpr uintptr_t kStreamAlign = 64;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void stream(float* p, V v) { _mm512_stream_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // max / min return their second operand when either is NaN.
  static V max_keep_nan(V lo, V y) { return _mm512_max_ps(lo, y); }
  static V min_keep_nan(V hi, V y) { return _mm512_min_ps(hi, y); }
  // roundscale and scalef replace the rounding and exponent tricks; y >= -126, so n >= -126 and f >= 0
  // when n = -126: results stay normal floats.
  static V exp2(V y) {
    const V n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp2_poly<Avx512Lanes>(_mm512_sub_ps(y, n)), n);
  }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static V add_at_lane(V v, int lane, float x) {
    return _mm512_mask_add_ps(v, static_cast<__mmask16>(1u << lane), v, _mm512_set1_ps(x));
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2Lanes {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr uintptr_t kStreamAlign = 32;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void stream(float* p, V v) { _mm256_stream_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V max_keep_nan(V lo, V y) { return _mm256_max_ps(lo, y); }
  static V min_keep_nan(V hi, V y) { return _mm256_min_ps(hi, y); }
  static V exp2(V y) {
    const V bias = _mm256_set1_ps(kRoundBias);
    const V k = _mm256_add_ps(y, bias);
    const V p = exp2_poly<Avx2Lanes>(_mm256_sub_ps(y, _mm256_sub_ps(k, bias)));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(k), 23)));
  }
  static float sum(V v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
  }
  static V add_at_lane(V v, int lane, float x) {
    const __m256i hit = _mm256_cmpeq_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(lane));
    return _mm256_add_ps(v, _mm256_and_ps(_mm256_castsi256_ps(hit), _mm256_set1_ps(x)));
  }
};
#endif

struct PortableLanes {
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t Bits __attribute__((vector_size(32)));
  static constexpr int kWidth = 8;
  static constexpr uintptr_t kStreamAlign = 0;  // no non-temporal stores
  static V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
  static void stream(float* p, V v) { store(p, v); }
  static V set1(float x) { return V{} + x; }
  static V zero() { return V{}; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V fmadd(V a, V b, V c) { return a * b + c; }
  static V max_keep_nan(V lo, V y) { return y < lo ? lo : y; }
  static V min_keep_nan(V hi, V y) { return y > hi ? hi : y; }
  // Vector casts between same-sized types reinterpret bits.
  static V exp2(V y) {
    const V k = y + kRoundBias;
    return exp2_poly<PortableLanes>(y - (k - kRoundBias)) * reinterpret_cast<V>(reinterpret_cast<Bits>(k) << 23);
  }
  static float sum(V v) {
    float total = 0.f;
    for (int i = 0; i < kWidth; ++i) total += v[i];
    return total;
  }
  static V add_at_lane(V v, int lane, float x) {
    v[lane] += x;
    return v;
  }
};

// Which lanes run: the widest the library was compiled for, unless PALESTRA_CPU_PORTABLE=1 asks for the
// portable ones (the tests run both). kernels/build.py `cpu_simd_level()` mirrors this choice.
enum class Level { kPortable, kAvx2, kAvx512 };

inline Level level() {
  const char* env = std::getenv("PALESTRA_CPU_PORTABLE");
  if (env != nullptr && std::strcmp(env, "1") == 0) return Level::kPortable;
#if defined(__AVX512F__)
  return Level::kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
  return Level::kAvx2;
#else
  return Level::kPortable;
#endif
}

// Calls f(Lanes{}) with the lane type of `l`.
template <class F>
decltype(auto) with_lanes(Level l, F&& f) {
  switch (l) {
#if defined(__AVX512F__)
    case Level::kAvx512:
      return f(Avx512Lanes{});
#endif
#if defined(__AVX2__) && defined(__FMA__)
    case Level::kAvx2:
      return f(Avx2Lanes{});
#endif
    default:
      return f(PortableLanes{});
  }
}

}  // namespace simd
}  // namespace palestra

#pragma GCC diagnostic pop
