// Fused running reward normalisation, CUDA kernels (see reward_norm.h for the three-kernel design).
//
// Numerics: statistics are float64 throughout. Kernel 1's moments are two-pass (mean first, then squared
// deviations from it) over a chunk (one segment) or a shared-memory tile (many segments), so they do not
// suffer the cancellation of sum / sum-of-squares; tiles and chunks are combined with Chan et al.'s merge.
// Every reduction has a fixed order (shuffle trees, chunk order), so results are bitwise reproducible.
//
// Segments: within a tile, a group of G lanes (G = 32 for up to 8 segments, fewer as S grows) owns one
// segment and scans the tile for its elements; the work is O(N * S / (threads per block / G)), which suits
// the few-agent case this op is for (S up to a few hundred).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "reward_norm.h"

namespace palestra {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 1024;                        // rewards per shared-memory tile (segmented moments)
constexpr int64_t kMinChunk = 4096;                // rewards per chunk, at least
constexpr int64_t kMaxChunks = 2048;               // chunks, at most
constexpr int64_t kMaxPartials = int64_t{1} << 22; // chunks x segments, at most
constexpr int64_t kNone = INT64_MAX;               // "no such index" inside the kernels

template <typename T>
__device__ __forceinline__ double load_double(const T* p, int64_t i);
template <>
__device__ __forceinline__ double load_double<float>(const float* p, int64_t i) {
  return static_cast<double>(p[i]);
}
template <>
__device__ __forceinline__ double load_double<double>(const double* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ double load_double<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return static_cast<double>(__bfloat162float(p[i]));
}
template <>
__device__ __forceinline__ double load_double<__half>(const __half* p, int64_t i) {
  return static_cast<double>(__half2float(p[i]));
}

// The write pass computes in float32, or float64 for float64 rewards.
template <typename T>
struct WriteMath {
  using type = float;
};
template <>
struct WriteMath<double> {
  using type = double;
};

__device__ __forceinline__ void chan_merge(double& n_a, double& mean_a, double& m2_a, double n_b, double mean_b,
                                           double m2_b) {
  if (n_b == 0.0) return;
  const double n = n_a + n_b;
  const double delta = mean_b - mean_a;
  mean_a = mean_a + delta * (n_b / n);
  m2_a = m2_a + m2_b + delta * delta * (n_a * n_b / n);
  n_a = n;
}

struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return a + b;
  }
};
struct MinOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return b < a ? b : a;
  }
};

// Block-wide reduction with a fixed tree; every thread gets the result. `scratch` holds kWarps values.
template <typename V, typename Op>
__device__ V block_reduce(V v, V* scratch, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) v = op(v, scratch[w]);
  return v;
}

// Sum over an aligned group of `group` lanes (a power of two <= 32); every lane of the group gets it.
__device__ __forceinline__ double group_sum(double v, int group) {
  for (int o = group >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Lanes per segment in the segmented moments: 32 for S <= kThreads / 32, then halving as S grows.
__host__ __device__ __forceinline__ int lanes_per_segment(int64_t S) {
  int g = 32;
  while (g > 1 && static_cast<int64_t>(kThreads / g) < S) g >>= 1;
  return g;
}

// ---- kernel 1: checks and per-chunk partials ------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rn_partials(const T* __restrict__ x, const int64_t* __restrict__ seg, int64_t n, int64_t S, int64_t chunk,
                int64_t num_chunks, bool update, double* __restrict__ part, int64_t* __restrict__ chunk_errors) {
  __shared__ double scratch_d[kWarps];
  __shared__ int64_t scratch_i[kWarps];
  const int64_t c = blockIdx.x;
  const int64_t begin = c * chunk;
  const int64_t end = begin + chunk < n ? begin + chunk : n;

  // Checks. Each thread walks its elements in increasing order, so its first hit is its smallest.
  int64_t nonfinite = 0, first_nonfinite = kNone, first_bad = kNone, bad_value = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double v = load_double(x, i);
    if (!isfinite(v)) {
      if (first_nonfinite == kNone) first_nonfinite = i;
      ++nonfinite;
    }
    if (seg != nullptr && first_bad == kNone) {
      const int64_t s = seg[i];
      if (s < 0 || s >= S) {
        first_bad = i;
        bad_value = s;
      }
    }
  }
  const int64_t my_first_bad = first_bad;
  nonfinite = block_reduce(nonfinite, scratch_i, SumOp{});
  first_nonfinite = block_reduce(first_nonfinite, scratch_i, MinOp{});
  first_bad = block_reduce(first_bad, scratch_i, MinOp{});
  if (threadIdx.x == 0) {
    chunk_errors[c * 4 + 0] = nonfinite;
    chunk_errors[c * 4 + 1] = first_nonfinite;
    chunk_errors[c * 4 + 2] = first_bad;
    if (first_bad == kNone) chunk_errors[c * 4 + 3] = 0;
  }
  if (first_bad != kNone && my_first_bad == first_bad) chunk_errors[c * 4 + 3] = bad_value;  // one thread
  // Both conditions are block-uniform, so no thread is left waiting at a barrier.
  if (!update || nonfinite != 0 || first_bad != kNone) return;

  const int64_t plane = num_chunks * S;
  if (seg == nullptr) {
    // One segment: two passes over the chunk (the second reads it from L2).
    double sum = 0.0;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) sum += load_double(x, i);
    sum = block_reduce(sum, scratch_d, SumOp{});
    const double count = static_cast<double>(end - begin);
    const double mean = sum / count;
    double m2 = 0.0;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const double d = load_double(x, i) - mean;
      m2 += d * d;
    }
    m2 = block_reduce(m2, scratch_d, SumOp{});
    if (threadIdx.x == 0) {
      part[c] = count;
      part[plane + c] = mean;
      part[2 * plane + c] = m2;
    }
    return;
  }

  // Many segments: tiles in shared memory; a group of G lanes per segment, two passes per tile, Chan-merged
  // into this chunk's partials (which only this block writes, and only the group's leader for its segment).
  __shared__ double tile_x[kTile];
  __shared__ int64_t tile_s[kTile];
  double* p_n = part + c * S;
  double* p_mean = part + plane + c * S;
  double* p_m2 = part + 2 * plane + c * S;
  for (int64_t s = threadIdx.x; s < S; s += kThreads) {
    p_n[s] = 0.0;
    p_mean[s] = 0.0;
    p_m2[s] = 0.0;
  }
  const int group = lanes_per_segment(S);
  const int groups = kThreads / group;
  const int g = threadIdx.x / group;
  const int lane = threadIdx.x % group;
  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int len = static_cast<int>(end - t0 < kTile ? end - t0 : kTile);
    __syncthreads();  // the previous tile is consumed; the zeroed partials are visible
    for (int k = threadIdx.x; k < len; k += kThreads) {
      tile_x[k] = load_double(x, t0 + k);
      tile_s[k] = seg[t0 + k];
    }
    __syncthreads();
    for (int64_t base = 0; base < S; base += groups) {
      const int64_t s = base + g;  // s >= S matches nothing, but its lanes still join the shuffles
      double cnt = 0.0, sum = 0.0;
      for (int k = lane; k < len; k += group) {
        if (tile_s[k] == s) {
          cnt += 1.0;
          sum += tile_x[k];
        }
      }
      cnt = group_sum(cnt, group);
      sum = group_sum(sum, group);
      const double mean = cnt > 0.0 ? sum / cnt : 0.0;
      double m2 = 0.0;
      for (int k = lane; k < len; k += group) {
        if (tile_s[k] == s) {
          const double d = tile_x[k] - mean;
          m2 += d * d;
        }
      }
      m2 = group_sum(m2, group);
      if (lane == 0 && s < S && cnt > 0.0) chan_merge(p_n[s], p_mean[s], p_m2[s], cnt, mean, m2);
    }
  }
}

// ---- kernel 2: error summary, merge into the state, write coefficients ------------------------------
// One block per segment. Its threads fold strided sets of the chunks' partials (each in chunk order), then a
// fixed tree (warp shuffles, then the warps in order) merges the threads' results: deterministic, and
// O(num_chunks / kThreads + log) deep rather than a serial chain of num_chunks float64 divisions.
__global__ void __launch_bounds__(kThreads)
    rn_merge(const double* __restrict__ part, const int64_t* __restrict__ chunk_errors, int64_t num_chunks, int64_t S,
             double* __restrict__ count, double* __restrict__ mean, double* __restrict__ m2, double eps, bool update,
             int64_t* __restrict__ error_out, double* __restrict__ coefficients) {
  __shared__ int64_t scratch_i[kWarps];
  __shared__ double scratch_m[3 * kWarps];
  // Every block reduces the error records (num_chunks * S is bounded), so each knows whether to go on.
  int64_t nonfinite = 0, first_nonfinite = kNone, first_bad = kNone;
  for (int64_t c = threadIdx.x; c < num_chunks; c += kThreads) {
    nonfinite += chunk_errors[c * 4 + 0];
    first_nonfinite = min(first_nonfinite, static_cast<int64_t>(chunk_errors[c * 4 + 1]));
    first_bad = min(first_bad, static_cast<int64_t>(chunk_errors[c * 4 + 2]));
  }
  nonfinite = block_reduce(nonfinite, scratch_i, SumOp{});
  first_nonfinite = block_reduce(first_nonfinite, scratch_i, MinOp{});
  first_bad = block_reduce(first_bad, scratch_i, MinOp{});
  const bool clean = nonfinite == 0 && first_bad == kNone;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) {
      error_out[0] = nonfinite;
      error_out[1] = first_nonfinite == kNone ? -1 : first_nonfinite;
      error_out[2] = first_bad == kNone ? -1 : first_bad;
      if (first_bad == kNone) error_out[3] = 0;
    }
    if (first_bad != kNone) {  // the one chunk whose first bad index is the global first names the value
      for (int64_t c = threadIdx.x; c < num_chunks; c += kThreads) {
        if (chunk_errors[c * 4 + 2] == first_bad) error_out[3] = chunk_errors[c * 4 + 3];
      }
    }
  }
  if (!clean) return;  // block-uniform
  const int64_t s = blockIdx.x;
  const int64_t plane = num_chunks * S;
  double b_n = 0.0, b_mean = 0.0, b_m2 = 0.0;
  if (update) {
    for (int64_t c = threadIdx.x; c < num_chunks; c += kThreads) {
      chan_merge(b_n, b_mean, b_m2, part[c * S + s], part[plane + c * S + s], part[2 * plane + c * S + s]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const double o_n = __shfl_xor_sync(0xffffffffu, b_n, o);
      const double o_mean = __shfl_xor_sync(0xffffffffu, b_mean, o);
      const double o_m2 = __shfl_xor_sync(0xffffffffu, b_m2, o);
      chan_merge(b_n, b_mean, b_m2, o_n, o_mean, o_m2);
    }
    if ((threadIdx.x & 31) == 0) {
      const int w = threadIdx.x >> 5;
      scratch_m[3 * w + 0] = b_n;
      scratch_m[3 * w + 1] = b_mean;
      scratch_m[3 * w + 2] = b_m2;
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  double n_s = count[s], mean_s = mean[s], m2_s = m2[s];
  if (update) {
    b_n = b_mean = b_m2 = 0.0;
    for (int w = 0; w < kWarps; ++w) {
      chan_merge(b_n, b_mean, b_m2, scratch_m[3 * w], scratch_m[3 * w + 1], scratch_m[3 * w + 2]);
    }
    chan_merge(n_s, mean_s, m2_s, b_n, b_mean, b_m2);
    count[s] = n_s;
    mean[s] = mean_s;
    m2[s] = m2_s;
  }
  const bool has = n_s > 0.0;  // a segment without samples passes its rewards through (clipped)
  coefficients[s] = has ? mean_s : 0.0;
  coefficients[S + s] = has ? 1.0 / sqrt(m2_s / n_s + eps) : 1.0;
}

// ---- kernel 3: the write ------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rn_write(const T* __restrict__ x, const int64_t* __restrict__ seg, int64_t n, int64_t S,
             const double* __restrict__ coefficients, double clip, const int64_t* __restrict__ error_out,
             float* __restrict__ out) {
  using M = typename WriteMath<T>::type;
  if (error_out[0] != 0 || error_out[2] != -1) return;  // kernel 2 found a bad batch: leave `out` alone
  const M hi = static_cast<M>(clip);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const int64_t s = seg != nullptr ? seg[i] : 0;
    const M shift = static_cast<M>(coefficients[s]);
    const M scale = static_cast<M>(coefficients[S + s]);
    M y = (static_cast<M>(load_double(x, i)) - shift) * scale;
    y = y > hi ? hi : (y < -hi ? -hi : y);  // NaN (only from eps == 0 on a constant segment) stays NaN
    out[i] = static_cast<float>(y);
  }
}

template <typename T>
cudaError_t launch_typed(const T* x, const int64_t* seg, int64_t n, int64_t S, double* count, double* mean,
                         double* m2, double clip, double eps, bool update, float* out, double* partials,
                         int64_t* chunk_errors, int64_t* error_out, double* coefficients, cudaStream_t stream) {
  const RewardNormPlan plan = reward_norm_plan(n, S, update);
  rn_partials<T><<<static_cast<unsigned>(plan.num_chunks), kThreads, 0, stream>>>(
      x, seg, n, S, plan.chunk, plan.num_chunks, update, partials, chunk_errors);
  rn_merge<<<static_cast<unsigned>(S), kThreads, 0, stream>>>(
      partials, chunk_errors, plan.num_chunks, S, count, mean, m2, eps, update, error_out, coefficients);
  int64_t write_blocks = (n + kThreads - 1) / kThreads;
  if (write_blocks > 16384) write_blocks = 16384;  // grid-stride beyond this
  rn_write<T><<<static_cast<unsigned>(write_blocks), kThreads, 0, stream>>>(x, seg, n, S, coefficients, clip,
                                                                            error_out, out);
  return cudaGetLastError();
}

}  // namespace

RewardNormPlan reward_norm_plan(int64_t n, int64_t num_segments, bool update) {
  const int64_t S = num_segments < 1 ? 1 : num_segments;
  int64_t chunks = (n + kMinChunk - 1) / kMinChunk;
  if (chunks > kMaxChunks) chunks = kMaxChunks;
  const int64_t by_partials = kMaxPartials / S;
  if (chunks > by_partials) chunks = by_partials;
  if (chunks < 1) chunks = 1;
  int64_t chunk = (n + chunks - 1) / chunks;
  if (chunk < 1) chunk = 1;
  chunks = (n + chunk - 1) / chunk;
  if (chunks < 1) chunks = 1;
  return {chunks, chunk, update ? 3 * chunks * S : 0, 4 * chunks};
}

cudaError_t launch_normalize_rewards(const void* rewards, RewardDType dtype, const int64_t* segment_ids, int64_t n,
                                     int64_t num_segments, double* count, double* mean, double* m2, double clip,
                                     double eps, bool update, float* out, double* partials, int64_t* chunk_errors,
                                     int64_t* error_out, double* coefficients, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (dtype) {
    case RewardDType::kFloat32:
      return launch_typed(static_cast<const float*>(rewards), segment_ids, n, num_segments, count, mean, m2, clip, eps,
                          update, out, partials, chunk_errors, error_out, coefficients, stream);
    case RewardDType::kFloat64:
      return launch_typed(static_cast<const double*>(rewards), segment_ids, n, num_segments, count, mean, m2, clip,
                          eps, update, out, partials, chunk_errors, error_out, coefficients, stream);
    case RewardDType::kBFloat16:
      return launch_typed(static_cast<const __nv_bfloat16*>(rewards), segment_ids, n, num_segments, count, mean, m2,
                          clip, eps, update, out, partials, chunk_errors, error_out, coefficients, stream);
    case RewardDType::kFloat16:
      return launch_typed(static_cast<const __half*>(rewards), segment_ids, n, num_segments, count, mean, m2, clip,
                          eps, update, out, partials, chunk_errors, error_out, coefficients, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace palestra
