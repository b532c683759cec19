// CUDA kernels for the fused log-prob gather with entropy (see logprob_entropy.h for the contract).
//
// Both kernels are bandwidth kernels: one block per row streams the row once with 16-byte loads
// (8 bf16 / 8 fp16 / 4 fp32 per load), several loads in flight per thread (kUnroll), cache-streaming
// hints (__ldcs / __stcs) because a [N, V] logits tensor is far larger than L2 and is not re-read soon.
//
// Forward, per thread: a running max m (logit units) and, against it, s = sum 2^y and t = sum 2^y * y,
// y = (x - m) * log2(e) / T (base 2 so that exp is one ex2 instruction). A batch of kUnroll vectors
// raises m at most once (one rescale: s' = a s, t' = a (t + d s), d = (m - m') log2(e) / T, a = 2^d).
// The block then merges the per-thread triples the same way (warp shuffles, then shared memory), and
// lse = m / T + ln s, entropy = ln s - ln2 * t / s. Keeping t relative to m avoids cancelling two large
// numbers when the logits sit far from zero. Arguments of exp2 are clamped at -126 so that masked (-inf)
// logits contribute ~1e-38 rather than 0 * inf = NaN; the running max starts at the lowest finite float.
//
// Backward: p = 2^((x / T - lse) log2 e) is recomputed from the saved lse and the gradient is written
// once: g = p * (a + c * y) (+ g_logp / T at the token), a = -(g_logp + g_ent H) / T, c = -g_ent ln2 / T.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "logprob_entropy.h"

namespace palestra {
namespace cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kExp2Lo = -126.0f;
constexpr float kLowest = -3.4028234663852886e38f;
constexpr int kMaxThreads = 512;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread in the main loop

// ---- element types: 16-byte vectors and their widening / narrowing ---------------------------------
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kVec = 4;
  __device__ static float to_float(float v) { return v; }
  __device__ static float from_float(float v) { return v; }
  __device__ static void unpack(const uint4& v, float (&out)[kVec]) {
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
  }
  __device__ static uint4 pack(const float (&in)[kVec]) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]), __float_as_uint(in[3]));
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 8;
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  // bf16 -> fp32 is a 16-bit shift: the low half of each word moves up, the high half is masked.
  __device__ static void unpack(const uint4& v, float (&out)[kVec]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = __uint_as_float(w[k] << 16);
      out[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  }
  __device__ static uint4 pack(const float (&in)[kVec]) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(in[2 * k], in[2 * k + 1]);
      w[k] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct Elem<__half> {
  static constexpr int kVec = 8;
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ static void unpack(const uint4& v, float (&out)[kVec]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
      out[2 * k] = f.x;
      out[2 * k + 1] = f.y;
    }
  }
  __device__ static uint4 pack(const float (&in)[kVec]) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __half2 h = __floats2half2_rn(in[2 * k], in[2 * k + 1]);
      w[k] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// Elements before the first 16-byte boundary of a row (all of them if the row is shorter).
template <typename T>
__device__ __forceinline__ int64_t head_elements(const T* row, int64_t V) {
  const int64_t misaligned = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row) & 15u) / sizeof(T));
  const int64_t head = misaligned == 0 ? 0 : Elem<T>::kVec - misaligned;
  return head < V ? head : V;
}

// max(v, lo) that keeps a NaN v (fmaxf would drop it), so NaN logits give NaN results, as on the CPU.
__device__ __forceinline__ float clamp_lo(float v, float lo) { return v < lo ? lo : v; }

// ---- online (max, sum, sum * y) state --------------------------------------------------------------
struct Online {
  float m;  // running max, logit units
  float s;  // sum 2^y
  float t;  // sum 2^y * y, y = (x - m) * c2

  __device__ void init() {
    m = kLowest;
    s = 0.f;
    t = 0.f;
  }

  // Move to a larger max `m_new`; the gap is clamped before scaling so that it never overflows.
  __device__ __forceinline__ void raise_to(float m_new, float c2, float gap_lo) {
    const float d = fmaxf(m - m_new, gap_lo) * c2;
    const float a = exp2f(d);
    t = a * fmaf(d, s, t);
    s *= a;
    m = m_new;
  }

  template <int K>
  __device__ __forceinline__ void absorb(const float (&x)[K], float c2, float gap_lo) {
    float bm = x[0];
#pragma unroll
    for (int k = 1; k < K; ++k) bm = fmaxf(bm, x[k]);
    if (bm > m) raise_to(bm, c2, gap_lo);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float y = clamp_lo(x[k] - m, gap_lo) * c2;
      const float e = exp2f(y);
      s += e;
      t = fmaf(e, y, t);
    }
  }

  __device__ __forceinline__ void merge(const Online& o, float c2, float gap_lo) {
    const float m_new = fmaxf(m, o.m);
    const float d1 = fmaxf(m - m_new, gap_lo) * c2;
    const float d2 = fmaxf(o.m - m_new, gap_lo) * c2;
    const float a1 = exp2f(d1), a2 = exp2f(d2);
    t = a1 * fmaf(d1, s, t) + a2 * fmaf(d2, o.s, o.t);
    s = a1 * s + a2 * o.s;
    m = m_new;
  }
};

__device__ __forceinline__ Online warp_merge(Online v, float c2, float gap_lo) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Online o;
    o.m = __shfl_xor_sync(0xFFFFFFFFu, v.m, offset);
    o.s = __shfl_xor_sync(0xFFFFFFFFu, v.s, offset);
    o.t = __shfl_xor_sync(0xFFFFFFFFu, v.t, offset);
    v.merge(o, c2, gap_lo);
  }
  return v;
}

// ---- forward -----------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kMaxThreads) logprob_entropy_fwd_kernel(const T* __restrict__ logits,
                                                                          const int64_t* __restrict__ tokens,
                                                                          float* __restrict__ logp,
                                                                          float* __restrict__ entropy,
                                                                          float* __restrict__ lse, int64_t V,
                                                                          float inv_t, int64_t ignore_index) {
  constexpr int kVec = Elem<T>::kVec;
  const int64_t row_idx = blockIdx.x;
  const int64_t tok = tokens[row_idx];
  if (tok == ignore_index) {  // ignored rows are not read at all
    if (threadIdx.x == 0) logp[row_idx] = entropy[row_idx] = lse[row_idx] = 0.f;
    return;
  }
  const T* row = logits + row_idx * V;
  const float c2 = inv_t * kLog2e;
  const float gap_lo = kExp2Lo / c2;  // (x - m) >= gap_lo  <=>  y >= -126
  Online acc;
  acc.init();

  const int64_t head = head_elements(row, V);
  const int64_t n_vec = (V - head) / kVec;
  const int64_t tail_start = head + n_vec * kVec;
  const uint4* vrow = reinterpret_cast<const uint4*>(row + head);
  const int64_t stride = blockDim.x;

  for (int64_t j = threadIdx.x; j < head; j += stride) {
    const float x[1] = {Elem<T>::to_float(row[j])};
    acc.absorb(x, c2, gap_lo);
  }
  // Main loop: kUnroll independent 16-byte loads are issued before any of them is used.
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n_vec; i += kUnroll * stride) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = __ldcs(vrow + i + u * stride);
    float x[kUnroll * kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float part[kVec];
      Elem<T>::unpack(raw[u], part);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[u * kVec + k] = part[k];
    }
    acc.absorb(x, c2, gap_lo);
  }
  for (; i < n_vec; i += stride) {
    float x[kVec];
    Elem<T>::unpack(__ldcs(vrow + i), x);
    acc.absorb(x, c2, gap_lo);
  }
  for (int64_t j = tail_start + threadIdx.x; j < V; j += stride) {
    const float x[1] = {Elem<T>::to_float(row[j])};
    acc.absorb(x, c2, gap_lo);
  }

  // Block merge: warps, then the first warp over the warps' results.
  __shared__ float sm[32], ss[32], st[32];
  acc = warp_merge(acc, c2, gap_lo);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_warps = (blockDim.x + 31) >> 5;
  if (lane == 0) {
    sm[warp] = acc.m;
    ss[warp] = acc.s;
    st[warp] = acc.t;
  }
  __syncthreads();
  if (warp == 0) {
    if (lane < n_warps) {
      acc.m = sm[lane];
      acc.s = ss[lane];
      acc.t = st[lane];
    } else {
      acc.init();
    }
    acc = warp_merge(acc, c2, gap_lo);
    if (lane == 0) {
      const float log_s = logf(acc.s);
      const float row_lse = fmaf(acc.m, inv_t, log_s);
      lse[row_idx] = row_lse;
      entropy[row_idx] = fmaxf(fmaf(-kLn2, acc.t / acc.s, log_s), 0.f);
      // An out-of-range token is never dereferenced (the wrapper rejects it); its logp is NaN.
      // z_tok - lse as (x_tok - m) / T - ln s: no cancellation between two large numbers.
      logp[row_idx] = (tok >= 0 && tok < V) ? fminf((Elem<T>::to_float(row[tok]) - acc.m) * inv_t - log_s, 0.f)
                                            : __int_as_float(0x7FC00000);
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kMaxThreads) logprob_entropy_bwd_kernel(
    const float* __restrict__ grad_logp, const float* __restrict__ grad_entropy, const T* __restrict__ logits,
    const int64_t* __restrict__ tokens, const float* __restrict__ lse, const float* __restrict__ entropy,
    T* __restrict__ grad, int64_t V, float inv_t, int64_t ignore_index) {
  constexpr int kVec = Elem<T>::kVec;
  const int64_t row_idx = blockIdx.x;
  const int64_t tok = tokens[row_idx];
  const T* row = logits + row_idx * V;
  T* out = grad + row_idx * V;
  const int64_t head = head_elements(row, V);  // == head_elements(out, V): same address modulo 16
  const int64_t n_vec = (V - head) / kVec;
  const int64_t tail_start = head + n_vec * kVec;
  const uint4* vrow = reinterpret_cast<const uint4*>(row + head);
  uint4* vout = reinterpret_cast<uint4*>(out + head);
  const int64_t stride = blockDim.x;

  if (tok == ignore_index) {  // zero gradient, logits not read
    const float zero[kVec] = {};
    const uint4 z = Elem<T>::pack(zero);
    for (int64_t j = threadIdx.x; j < head; j += stride) out[j] = Elem<T>::from_float(0.f);
    for (int64_t i = threadIdx.x; i < n_vec; i += stride) __stcs(vout + i, z);
    for (int64_t j = tail_start + threadIdx.x; j < V; j += stride) out[j] = Elem<T>::from_float(0.f);
    return;
  }
  const float g_logp = grad_logp[row_idx];
  const float g_ent = grad_entropy[row_idx];
  const float row_lse = lse[row_idx];
  const float a = -inv_t * fmaf(g_ent, entropy[row_idx], g_logp);  // -(g_logp + g_ent H) / T
  const float c = -inv_t * g_ent * kLn2;
  const float tok_term = inv_t * g_logp;
  // g_j = 2^y (a + c y) with y = (x / T - lse) log2 e, clamped (before scaling) to keep 2^y finite.
  auto grad_of = [&](float x, int64_t j) {
    const float y = fminf(clamp_lo(fmaf(x, inv_t, -row_lse), -87.0f), 88.0f) * kLog2e;
    const float g = exp2f(y) * fmaf(c, y, a);
    return j == tok ? g + tok_term : g;
  };

  for (int64_t j = threadIdx.x; j < head; j += stride) {
    out[j] = Elem<T>::from_float(grad_of(Elem<T>::to_float(row[j]), j));
  }
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n_vec; i += kUnroll * stride) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = __ldcs(vrow + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float x[kVec];
      Elem<T>::unpack(raw[u], x);
      const int64_t col0 = head + (i + u * stride) * kVec;
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[k] = grad_of(x[k], col0 + k);
      __stcs(vout + i + u * stride, Elem<T>::pack(x));
    }
  }
  for (; i < n_vec; i += stride) {
    float x[kVec];
    Elem<T>::unpack(__ldcs(vrow + i), x);
    const int64_t col0 = head + i * kVec;
#pragma unroll
    for (int k = 0; k < kVec; ++k) x[k] = grad_of(x[k], col0 + k);
    __stcs(vout + i, Elem<T>::pack(x));
  }
  for (int64_t j = tail_start + threadIdx.x; j < V; j += stride) {
    out[j] = Elem<T>::from_float(grad_of(Elem<T>::to_float(row[j]), j));
  }
}

// Threads per row: enough for about kUnroll vectors each, a whole number of warps, at most kMaxThreads.
int threads_for(int64_t V, int vec) {
  const int64_t want = (V / vec + kUnroll - 1) / kUnroll;
  int threads = 32;
  while (threads < kMaxThreads && threads < want) threads *= 2;
  return threads;
}

template <typename T>
cudaError_t launch_fwd(const void* logits, const int64_t* tokens, float* logp, float* entropy, float* lse, int64_t N,
                       int64_t V, float inv_t, int64_t ignore_index, cudaStream_t stream) {
  const int threads = threads_for(V, Elem<T>::kVec);
  logprob_entropy_fwd_kernel<T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
      static_cast<const T*>(logits), tokens, logp, entropy, lse, V, inv_t, ignore_index);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const float* grad_logp, const float* grad_entropy, const void* logits, const int64_t* tokens,
                       const float* lse, const float* entropy, void* grad, int64_t N, int64_t V, float inv_t,
                       int64_t ignore_index, cudaStream_t stream) {
  const int threads = threads_for(V, Elem<T>::kVec);
  logprob_entropy_bwd_kernel<T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
      grad_logp, grad_entropy, static_cast<const T*>(logits), tokens, lse, entropy, static_cast<T*>(grad), V, inv_t,
      ignore_index);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_logprob_entropy_forward(const void* logits, LogitsDType dtype, const int64_t* tokens, float* logp,
                                           float* entropy, float* lse, int64_t N, int64_t V, float inv_temperature,
                                           int64_t ignore_index, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  if (N > 0x7FFFFFFF || V <= 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case LogitsDType::kFloat32:
      return launch_fwd<float>(logits, tokens, logp, entropy, lse, N, V, inv_temperature, ignore_index, stream);
    case LogitsDType::kBFloat16:
      return launch_fwd<__nv_bfloat16>(logits, tokens, logp, entropy, lse, N, V, inv_temperature, ignore_index,
                                       stream);
    case LogitsDType::kFloat16:
      return launch_fwd<__half>(logits, tokens, logp, entropy, lse, N, V, inv_temperature, ignore_index, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_logprob_entropy_backward(const float* grad_logp, const float* grad_entropy, const void* logits,
                                            LogitsDType dtype, const int64_t* tokens, const float* lse,
                                            const float* entropy, void* grad_logits, int64_t N, int64_t V,
                                            float inv_temperature, int64_t ignore_index, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  if (N > 0x7FFFFFFF || V <= 0) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(logits) & 15u) != (reinterpret_cast<uintptr_t>(grad_logits) & 15u)) {
    return cudaErrorMisalignedAddress;
  }
  switch (dtype) {
    case LogitsDType::kFloat32:
      return launch_bwd<float>(grad_logp, grad_entropy, logits, tokens, lse, entropy, grad_logits, N, V,
                               inv_temperature, ignore_index, stream);
    case LogitsDType::kBFloat16:
      return launch_bwd<__nv_bfloat16>(grad_logp, grad_entropy, logits, tokens, lse, entropy, grad_logits, N, V,
                                       inv_temperature, ignore_index, stream);
    case LogitsDType::kFloat16:
      return launch_bwd<__half>(grad_logp, grad_entropy, logits, tokens, lse, entropy, grad_logits, N, V,
                                inv_temperature, ignore_index, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace palestra
