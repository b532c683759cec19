// Fused running reward normalisation, CUDA kernels: torch-free launcher interface.
//
// The op runs as three kernels on one stream (one op call from the caller's view):
//   1. rn_partials  one block per chunk of rewards: checks the chunk (NaN/inf rewards, segment ids outside
//                   [0, S)) and, when updating, writes per-segment (count, mean, M2) partials, computed
//                   with exact two-pass moments (never naive sum / sum of squares);
//   2. rn_merge     one block per segment: reduces the chunks' error records; if the batch is clean,
//                   Chan-merges the partials with a fixed tree (deterministic) and folds them into the
//                   running state in place; writes each segment's (shift, scale) for the write pass;
//   3. rn_write     out = clamp((r - shift[s]) * scale[s], -clip, clip) in float32 (float64 math for
//                   float64 rewards); skipped when kernel 2 found an error.
// A single kernel cannot see every block's partials before writing without a grid-wide barrier
// (cooperative launch limits the grid to what fits at once); three stream-ordered launches are simpler
// and cost two extra launch latencies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace palestra {
namespace cuda {

enum class RewardDType : int { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };

// How the rewards are cut into chunks (one block of kernel 1 each) and how much workspace the caller
// must allocate, as a function of n, S and update alone.
struct RewardNormPlan {
  int64_t num_chunks;         // blocks of kernel 1
  int64_t chunk;              // rewards per chunk (the last one may be shorter)
  int64_t partial_doubles;    // float64 partials: [3, num_chunks, S] when updating, else 0
  int64_t chunk_error_slots;  // int64 error records: [num_chunks, 4]
};

RewardNormPlan reward_norm_plan(int64_t n, int64_t num_segments, bool update);

// Launches the three kernels on `stream`. `segment_ids` may be null (one segment). Workspace, sized by
// reward_norm_plan: `partials` (may be null when !update), `chunk_errors`, `error_out` [4] and
// `coefficients` [2 * S] (float64). After the stream reaches the end, error_out holds
// {number of non-finite rewards, flat index of the first (-1 if none),
//  flat index of the first segment id outside [0, S) (-1 if none), that id's value}; on any error the
// state and `out` are left untouched. Returns the launch error, if any.
cudaError_t launch_normalize_rewards(const void* rewards, RewardDType dtype, const int64_t* segment_ids, int64_t n,
                                     int64_t num_segments, double* count, double* mean, double* m2, double clip,
                                     double eps, bool update, float* out, double* partials, int64_t* chunk_errors,
                                     int64_t* error_out, double* coefficients, cudaStream_t stream);

}  // namespace cuda
}  // namespace palestra
