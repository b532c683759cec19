// CUDA launchers for the advantage estimators. Plain C++ over raw device pointers, sizes and a stream;
// no PyTorch headers, so the kernels build with nvcc alone. The checks live in advantages_binding.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace palestra {
namespace cuda {

// Reverse scan over [B, T] rows (row-major), skipping padding (mask == 0) wherever it sits.
//
// With values != nullptr (GAE): adv[b, t] = delta_t + c * adv(next valid step), where
// delta_t = r_t + gamma * V(next valid step) - V_t and the step after the last valid one has
// value bootstrap[b] and advantage 0; ret = adv + V. With values == nullptr (discounted returns):
// adv[b, t] = r_t + c * adv(next valid step), and bootstrap / ret are ignored (pass nullptr).
// Outputs are 0 at padding. c = gamma * lam (GAE) or gamma (returns); log2c = log2(c), or any value
// <= -1e4 when c == 0 (so that c**n evaluates to exactly 0 for n >= 1).
cudaError_t launch_reverse_scan(const float* rewards, const float* values, const uint8_t* mask, const float* bootstrap,
                                float* adv, float* ret, int64_t B, int64_t T, float gamma, float c, float log2c,
                                cudaStream_t stream);

// Group statistics over rewards[B], groups = contiguous blocks of group_size (B % group_size == 0).
enum GroupMode : int {
  kGroupCentre = 0,     // r - group mean                          (Dr.GRPO)
  kGroupStd = 1,        // (r - group mean) / (group std + eps)    (GRPO)
  kGroupBatchStd = 2,   // (r - group mean) / (batch std + eps)
  kGroupLeaveOneOut = 3 // r - mean of the other members            (RLOO, group_size >= 2)
};
// std is the unbiased one (n - 1), 0 for a single element. workspace: one float of device memory
// (holds the batch std for kGroupBatchStd; unused otherwise).
cudaError_t launch_group_advantages(const float* rewards, float* out, float* workspace, int64_t B, int64_t group_size,
                                    int mode, float eps, cudaStream_t stream);

}  // namespace cuda
}  // namespace palestra
