// CUDA kernels for the advantage estimators (declarations and semantics in advantages.h).
//
// Reverse scan (GAE / discounted returns): one warp per row. One thread per row would read column t of
// a row-major [B, T] batch, a stride-T access that coalesces nothing. Instead the warp walks its row in
// tiles of 32 x kPerLane steps from the end; lane l owns kPerLane consecutive steps (descending time),
// so a tile is one contiguous stretch of the row. Per tile:
//   1. each lane summarises its steps: whether one is valid and the value of its earliest valid step;
//      a warp scan ("nearest valid wins") gives every lane the value of the next valid step after it;
//   2. each lane computes its deltas sequentially, then summarises them as the affine map
//      x -> c**n * x + b (n = its valid steps); a warp scan composes the maps of the lanes before it;
//   3. each lane applies that map to the tile's carry, then replays its steps sequentially, writing
//      adv/ret; the last lane's state is the carry for the next (earlier) tile.
// Exact in fp32: the recurrence is evaluated, not truncated, and a composed multiplier c**n is
// evaluated as exp2(n * log2 c) (a few ulps whatever n) instead of a running product of the rounded
// c, whose error would compound over long rows when gamma * lam is close to 1.
//
// Group ops: one warp per group (loops over any group size), sums in double; the batch std for the
// "batch" scale comes from a one-block pre-pass.
#include "advantages.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace palestra {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kPerLane = 8;
constexpr int kTile = kWarp * kPerLane;
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float pow_c(int n, float log2c) {
  return n == 0 ? 1.0f : exp2f(static_cast<float>(n) * log2c);
}

template <bool kValues>
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock)
    reverse_scan_kernel(const float* __restrict__ rewards, const float* __restrict__ values,
                        const uint8_t* __restrict__ mask, const float* __restrict__ bootstrap, float* __restrict__ adv,
                        float* __restrict__ ret, int64_t B, int64_t T, float gamma, float c, float log2c) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= B) return;  // uniform across the warp: every shuffle below sees all 32 lanes
  const float* r = rewards + row * T;
  const float* v = kValues ? values + row * T : nullptr;
  const uint8_t* m = mask + row * T;
  float* a_out = adv + row * T;
  float* r_out = kValues ? ret + row * T : nullptr;

  float next_value = kValues ? bootstrap[row] : 0.0f;  // value of the nearest valid step after the tile
  float next_adv = 0.0f;                               // its advantage

  for (int64_t tile_end = T; tile_end > 0; tile_end -= kTile) {
    const int64_t t0 = tile_end - 1 - static_cast<int64_t>(lane) * kPerLane;  // this lane's latest step
    float rv[kPerLane], vv[kPerLane];
    bool ok[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t t = t0 - j;
      const bool inb = t >= 0;
      ok[j] = inb && m[t] != 0;
      rv[j] = inb ? r[t] : 0.0f;
      vv[j] = (kValues && inb) ? v[t] : 0.0f;
    }

    // 1. value of the nearest valid step after this lane's steps.
    float value_in = next_value;
    if (kValues) {
      int has = 0;
      float earliest = 0.0f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (ok[j]) {
          has = 1;
          earliest = vv[j];
        }
      }
      // Inclusive scan over lanes (lane order = descending time): a lane with a valid step keeps its
      // own value, otherwise it takes the nearest lane before it that has one.
#pragma unroll
      for (int off = 1; off < kWarp; off <<= 1) {
        const int has_up = __shfl_up_sync(kFullMask, has, off);
        const float val_up = __shfl_up_sync(kFullMask, earliest, off);
        if (lane >= off && !has) {
          has = has_up;
          earliest = val_up;
        }
      }
      const int has_before = __shfl_up_sync(kFullMask, has, 1);
      const float val_before = __shfl_up_sync(kFullMask, earliest, 1);
      if (lane > 0 && has_before) value_in = val_before;
    }

    // 2. deltas (sequential in the lane), and the lane's map x -> c**n * x + b over them.
    float delta[kPerLane];
    float nv = value_in;
    int n = 0;
    float b = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const float d = kValues ? rv[j] + gamma * nv - vv[j] : rv[j];
      delta[j] = ok[j] ? d : 0.0f;
      if (kValues && ok[j]) nv = vv[j];
      if (ok[j]) {
        b = delta[j] + c * b;
        ++n;
      }
    }
    // Inclusive scan of the maps: the earlier lane's map applies first, so (n1, b1) then (n2, b2)
    // gives (n1 + n2, b2 + c**n2 * b1).
#pragma unroll
    for (int off = 1; off < kWarp; off <<= 1) {
      const int n_up = __shfl_up_sync(kFullMask, n, off);
      const float b_up = __shfl_up_sync(kFullMask, b, off);
      if (lane >= off) {
        b = b + pow_c(n, log2c) * b_up;
        n += n_up;
      }
    }
    int n_before = __shfl_up_sync(kFullMask, n, 1);
    float b_before = __shfl_up_sync(kFullMask, b, 1);
    if (lane == 0) {
      n_before = 0;
      b_before = 0.0f;
    }

    // 3. the advantage entering this lane's steps, then the steps themselves.
    float a = b_before + pow_c(n_before, log2c) * next_adv;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t t = t0 - j;
      if (ok[j]) a = delta[j] + c * a;
      if (t >= 0) {
        a_out[t] = ok[j] ? a : 0.0f;
        if (kValues) r_out[t] = ok[j] ? a + vv[j] : 0.0f;
      }
    }
    next_adv = __shfl_sync(kFullMask, a, kWarp - 1);
    if (kValues) next_value = __shfl_sync(kFullMask, nv, kWarp - 1);
  }
}

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// Unbiased std of x[0..n) into *out, by one block (two passes, double sums).
constexpr int kStdThreads = 1024;
__global__ void __launch_bounds__(kStdThreads) batch_std_kernel(const float* __restrict__ x, int64_t n, float* out) {
  __shared__ double partial[kStdThreads / kWarp];
  __shared__ double mean_shared;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  s = warp_sum(s);
  if (lane == 0) partial[warp] = s;
  __syncthreads();
  if (warp == 0) {
    double t = lane < static_cast<int>(blockDim.x / kWarp) ? partial[lane] : 0.0;
    t = warp_sum(t);
    if (lane == 0) mean_shared = t / static_cast<double>(n);
  }
  __syncthreads();
  const double mean = mean_shared;
  double ss = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double d = x[i] - mean;
    ss += d * d;
  }
  ss = warp_sum(ss);
  __syncthreads();  // everyone has read partial[] for the mean
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    double t = lane < static_cast<int>(blockDim.x / kWarp) ? partial[lane] : 0.0;
    t = warp_sum(t);
    if (lane == 0) *out = static_cast<float>(sqrt(n > 1 ? t / static_cast<double>(n - 1) : 0.0));
  }
}

__global__ void __launch_bounds__(kWarp * kWarpsPerBlock)
    group_kernel(const float* __restrict__ rewards, float* __restrict__ out, const float* __restrict__ batch_std,
                 int64_t groups, int64_t k, int mode, float eps) {
  const int lane = threadIdx.x % kWarp;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (g >= groups) return;
  const float* x = rewards + g * k;
  float* y = out + g * k;
  double s = 0.0;
  for (int64_t i = lane; i < k; i += kWarp) s += x[i];
  const double mean = warp_sum(s) / static_cast<double>(k);
  double scale = 1.0;  // multiplies (r - mean)
  if (mode == kGroupStd) {
    double ss = 0.0;
    for (int64_t i = lane; i < k; i += kWarp) {
      const double d = x[i] - mean;
      ss += d * d;
    }
    ss = warp_sum(ss);
    scale = 1.0 / (sqrt(k > 1 ? ss / static_cast<double>(k - 1) : 0.0) + eps);
  } else if (mode == kGroupBatchStd) {
    scale = 1.0 / (static_cast<double>(*batch_std) + eps);
  } else if (mode == kGroupLeaveOneOut) {
    // r - (sum - r) / (k - 1) == k / (k - 1) * (r - mean)
    scale = static_cast<double>(k) / static_cast<double>(k - 1);
  }
  for (int64_t i = lane; i < k; i += kWarp) y[i] = static_cast<float>((x[i] - mean) * scale);
}

unsigned blocks_for(int64_t warps) {
  return static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

cudaError_t launch_reverse_scan(const float* rewards, const float* values, const uint8_t* mask, const float* bootstrap,
                                float* adv, float* ret, int64_t B, int64_t T, float gamma, float c, float log2c,
                                cudaStream_t stream) {
  if (B <= 0 || T <= 0) return cudaSuccess;
  const dim3 grid(blocks_for(B)), block(kWarp * kWarpsPerBlock);
  if (values != nullptr) {
    reverse_scan_kernel<true>
        <<<grid, block, 0, stream>>>(rewards, values, mask, bootstrap, adv, ret, B, T, gamma, c, log2c);
  } else {
    reverse_scan_kernel<false>
        <<<grid, block, 0, stream>>>(rewards, nullptr, mask, nullptr, adv, nullptr, B, T, gamma, c, log2c);
  }
  return cudaGetLastError();
}

cudaError_t launch_group_advantages(const float* rewards, float* out, float* workspace, int64_t B, int64_t group_size,
                                    int mode, float eps, cudaStream_t stream) {
  if (B <= 0) return cudaSuccess;
  if (group_size <= 0 || B % group_size != 0 || mode < kGroupCentre || mode > kGroupLeaveOneOut) {
    return cudaErrorInvalidValue;
  }
  if (mode == kGroupBatchStd) {
    batch_std_kernel<<<1, kStdThreads, 0, stream>>>(rewards, B, workspace);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t groups = B / group_size;
  group_kernel<<<blocks_for(groups), kWarp * kWarpsPerBlock, 0, stream>>>(rewards, out, workspace, groups, group_size,
                                                                          mode, eps);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace palestra
