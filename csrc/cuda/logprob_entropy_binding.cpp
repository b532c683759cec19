// CUDA implementations of palestra::logprob_entropy and palestra::logprob_entropy_backward (schemas in
// ../ops.cpp): tensor checks, then the torch-free launchers of logprob_entropy.cu on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "logprob_entropy.h"

namespace palestra {
namespace {

constexpr const char* kOp = "palestra::logprob_entropy";

cuda::LogitsDType logits_dtype(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kFloat: return cuda::LogitsDType::kFloat32;
    case at::kBFloat16: return cuda::LogitsDType::kBFloat16;
    case at::kHalf: return cuda::LogitsDType::kFloat16;
    default:
      TORCH_CHECK(false, kOp, ": logits dtype must be float32, bfloat16 or float16, got ", logits.scalar_type());
  }
}

void check_inputs(const at::Tensor& logits, const at::Tensor& tokens, double temperature) {
  TORCH_CHECK(logits.is_cuda(), kOp, ": logits must be a CUDA tensor, got ", logits.device());
  TORCH_CHECK(logits.dim() == 2, kOp, ": logits must be 2-D [N, V], got ", logits.sizes());
  TORCH_CHECK(logits.size(1) > 0, kOp, ": logits has an empty vocabulary (V = 0)");
  TORCH_CHECK(tokens.device() == logits.device(), kOp, ": tokens is on ", tokens.device(), " but logits is on ",
              logits.device());
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == logits.size(0), kOp, ": tokens must be [", logits.size(0),
              "], got ", tokens.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kLong, kOp, ": tokens must be int64, got ", tokens.scalar_type());
  TORCH_CHECK(temperature > 0.0, kOp, ": temperature must be > 0, got ", temperature);
  TORCH_CHECK(logits.size(0) <= INT32_MAX, kOp, ": at most 2^31 - 1 rows, got ", logits.size(0));
}

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, kOp, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

// Per-row float32 vector on the logits' device, contiguous.
at::Tensor row_vector(const at::Tensor& t, const at::Tensor& logits, const char* name) {
  TORCH_CHECK(t.numel() == logits.size(0), kOp, "_backward: ", name, " must have ", logits.size(0),
              " elements, got ", t.sizes());
  TORCH_CHECK(t.device() == logits.device(), kOp, "_backward: ", name, " is on ", t.device(), " but logits is on ",
              logits.device());
  return t.reshape({logits.size(0)}).to(at::kFloat).contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> logprob_entropy_cuda(const at::Tensor& logits_in,
                                                                    const at::Tensor& tokens_in, double temperature,
                                                                    int64_t ignore_index) {
  check_inputs(logits_in, tokens_in, temperature);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor tokens = tokens_in.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor logp = at::empty({N}, opts), entropy = at::empty({N}, opts), lse = at::empty({N}, opts);
  check_launch(cuda::launch_logprob_entropy_forward(
      logits.const_data_ptr(), logits_dtype(logits), tokens.const_data_ptr<int64_t>(), logp.mutable_data_ptr<float>(),
      entropy.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>(), N, V, static_cast<float>(1.0 / temperature),
      ignore_index, c10::cuda::getCurrentCUDAStream()));
  return {logp, entropy, lse};
}

at::Tensor logprob_entropy_backward_cuda(const at::Tensor& grad_logp, const at::Tensor& grad_entropy,
                                         const at::Tensor& logits_in, const at::Tensor& tokens_in,
                                         const at::Tensor& lse, const at::Tensor& entropy, double temperature,
                                         int64_t ignore_index) {
  check_inputs(logits_in, tokens_in, temperature);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  at::Tensor logits = logits_in.contiguous();
  // The kernel needs logits and the fresh (aligned) gradient to line up modulo 16 bytes; a view with an
  // odd storage offset is copied once rather than falling back to scalar access.
  if ((reinterpret_cast<uintptr_t>(logits.const_data_ptr()) & 15u) != 0) logits = logits.clone();
  const at::Tensor tokens = tokens_in.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  const at::Tensor g_logp = row_vector(grad_logp, logits, "grad_logp");
  const at::Tensor g_ent = row_vector(grad_entropy, logits, "grad_entropy");
  const at::Tensor lse_f = row_vector(lse, logits, "lse");
  const at::Tensor ent_f = row_vector(entropy, logits, "entropy");
  at::Tensor grad = at::empty({N, V}, logits.options());
  check_launch(cuda::launch_logprob_entropy_backward(
      g_logp.const_data_ptr<float>(), g_ent.const_data_ptr<float>(), logits.const_data_ptr(), logits_dtype(logits),
      tokens.const_data_ptr<int64_t>(), lse_f.const_data_ptr<float>(), ent_f.const_data_ptr<float>(),
      grad.mutable_data_ptr(), N, V, static_cast<float>(1.0 / temperature), ignore_index,
      c10::cuda::getCurrentCUDAStream()));
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(palestra, CUDA, m) {
  m.impl("logprob_entropy", &logprob_entropy_cuda);
  m.impl("logprob_entropy_backward", &logprob_entropy_backward_cuda);
}

}  // namespace palestra
