// CUDA implementations of the advantage ops (schemas in ../ops.cpp): tensor checks, then the plain
// launchers of advantages.cu on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "advantages.h"

namespace palestra {
namespace {

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but rewards is on ", like.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_shape(const at::Tensor& t, const char* op, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " has shape ", t.sizes(), ", expected ", shape);
}

void check_discount(const char* op, double gamma, double lam) {
  TORCH_CHECK(gamma >= 0.0 && gamma <= 1.0, op, ": gamma must be in [0, 1], got ", gamma);
  TORCH_CHECK(lam >= 0.0 && lam <= 1.0, op, ": lam must be in [0, 1], got ", lam);
}

// log2(c) for the kernels' c**n = exp2(n * log2 c); floored so that c == 0 gives 0**n = 0 (n >= 1), not NaN.
float floored_log2(double c) {
  return static_cast<float>(c > 0.0 ? std::max(std::log2(c), -1.0e4) : -1.0e4);
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                                            const at::Tensor& bootstrap_value, double gamma, double lam) {
  constexpr const char* op = "gae";
  TORCH_CHECK(rewards.dim() == 2, op, ": rewards has shape ", rewards.sizes(), ", expected [B, T]");
  const int64_t B = rewards.size(0), T = rewards.size(1);
  check_cuda(rewards, rewards, op, "rewards", at::kFloat);
  check_cuda(values, rewards, op, "values", at::kFloat);
  check_cuda(mask, rewards, op, "mask", at::kBool);
  check_cuda(bootstrap_value, rewards, op, "bootstrap_value", at::kFloat);
  check_shape(values, op, "values", rewards.sizes());
  check_shape(mask, op, "mask", rewards.sizes());
  check_shape(bootstrap_value, op, "bootstrap_value", {B});
  check_discount(op, gamma, lam);
  const c10::cuda::CUDAGuard guard(rewards.device());
  auto adv = at::empty({B, T}, rewards.options());
  auto ret = at::empty({B, T}, rewards.options());
  check_launch(cuda::launch_reverse_scan(rewards.const_data_ptr<float>(), values.const_data_ptr<float>(),
                                         reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>()),
                                         bootstrap_value.const_data_ptr<float>(), adv.mutable_data_ptr<float>(),
                                         ret.mutable_data_ptr<float>(), B, T, static_cast<float>(gamma),
                                         static_cast<float>(gamma * lam), floored_log2(gamma * lam),
                                         c10::cuda::getCurrentCUDAStream()),
               op);
  return {adv, ret};
}

at::Tensor discounted_returns_cuda(const at::Tensor& rewards, const at::Tensor& mask, double gamma) {
  constexpr const char* op = "discounted_returns";
  TORCH_CHECK(rewards.dim() == 2, op, ": rewards has shape ", rewards.sizes(), ", expected [B, T]");
  const int64_t B = rewards.size(0), T = rewards.size(1);
  check_cuda(rewards, rewards, op, "rewards", at::kFloat);
  check_cuda(mask, rewards, op, "mask", at::kBool);
  check_shape(mask, op, "mask", rewards.sizes());
  check_discount(op, gamma, 1.0);
  const c10::cuda::CUDAGuard guard(rewards.device());
  auto out = at::empty({B, T}, rewards.options());
  check_launch(cuda::launch_reverse_scan(rewards.const_data_ptr<float>(), nullptr,
                                         reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>()), nullptr,
                                         out.mutable_data_ptr<float>(), nullptr, B, T, static_cast<float>(gamma),
                                         static_cast<float>(gamma), floored_log2(gamma),
                                         c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor run_groups(const char* op, const at::Tensor& rewards, int64_t group_size, int64_t min_size, int mode,
                      double eps) {
  check_cuda(rewards, rewards, op, "rewards", at::kFloat);
  TORCH_CHECK(rewards.dim() == 1, op, ": rewards has shape ", rewards.sizes(), ", expected [B]");
  TORCH_CHECK(group_size >= min_size, op, ": group_size must be >= ", min_size, ", got ", group_size);
  TORCH_CHECK(rewards.size(0) % group_size == 0, op, ": group_size ", group_size, " does not divide the batch size ",
              rewards.size(0));
  const c10::cuda::CUDAGuard guard(rewards.device());
  auto out = at::empty_like(rewards);
  auto workspace = at::empty({1}, rewards.options());
  check_launch(cuda::launch_group_advantages(rewards.const_data_ptr<float>(), out.mutable_data_ptr<float>(),
                                             workspace.mutable_data_ptr<float>(), rewards.size(0), group_size, mode,
                                             static_cast<float>(eps), c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor group_advantages_cuda(const at::Tensor& rewards, int64_t group_size, int64_t scale, double eps) {
  TORCH_CHECK(scale >= 0 && scale <= 2, "group_advantages: scale must be 0 (none), 1 (group) or 2 (batch), got ", scale);
  return run_groups("group_advantages", rewards, group_size, 1, static_cast<int>(scale), eps);
}

at::Tensor rloo_advantages_cuda(const at::Tensor& rewards, int64_t group_size) {
  return run_groups("rloo_advantages", rewards, group_size, 2, cuda::kGroupLeaveOneOut, 0.0);
}

}  // namespace

TORCH_LIBRARY_IMPL(palestra, CUDA, m) {
  m.impl("gae", &gae_cuda);
  m.impl("discounted_returns", &discounted_returns_cuda);
  m.impl("group_advantages", &group_advantages_cuda);
  m.impl("rloo_advantages", &rloo_advantages_cuda);
}

}  // namespace palestra
