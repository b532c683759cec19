// Fused log-prob gather with entropy, CUDA kernels: torch-free launcher interface (raw pointers, sizes,
// a stream). Argument checks live in logprob_entropy_binding.cpp.
//
// For logits [N, V] (row-major, fp32 / bf16 / fp16) and tokens [N] (int64), with z = logits * inv_temperature:
//   logp[i]    = min(z[i, tok] - lse[i], 0),   lse[i] = logsumexp(z[i, :]),
//   entropy[i] = -sum softmax(z[i]) * log softmax(z[i])      (all float32).
// Rows whose token == ignore_index are not read: logp = entropy = lse = 0 there. A token outside [0, V)
// that is not ignore_index is never dereferenced: its row gets logp = NaN (the Python wrapper rejects
// such tokens before launching).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace palestra {
namespace cuda {

enum class LogitsDType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// One block per row, one read of the row: online max with s = sum 2^y, t = sum 2^y * y against the
// running max (y = (z - m) * log2 e), 16-byte loads. Any alignment of `logits` is accepted.
cudaError_t launch_logprob_entropy_forward(const void* logits, LogitsDType dtype, const int64_t* tokens, float* logp,
                                           float* entropy, float* lse, int64_t N, int64_t V, float inv_temperature,
                                           int64_t ignore_index, cudaStream_t stream);

// grad_logits[i, j] = inv_temperature * (g_logp[i] * (1[j == tok] - p_ij)
//                                        - g_entropy[i] * p_ij * (z_ij - lse[i] + H[i]))
// with p = exp(z - lse), written once in the logits' dtype (zeros at ignored rows). One block per row,
// 16-byte loads and stores. `logits` and `grad_logits` must have the same address modulo 16 (e.g. both
// 16-byte aligned), so that their rows line up for vector access.
cudaError_t launch_logprob_entropy_backward(const float* grad_logp, const float* grad_entropy, const void* logits,
                                            LogitsDType dtype, const int64_t* tokens, const float* lse,
                                            const float* entropy, void* grad_logits, int64_t N, int64_t V,
                                            float inv_temperature, int64_t ignore_index, cudaStream_t stream);

}  // namespace cuda
}  // namespace palestra
