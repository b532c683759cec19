// Torch binding of the CUDA reward normalisation kernels (reward_norm.cu): checks, workspace, launch, and
// the one read-back that turns a bad batch into a loud one-line error.
//
// The error read-back synchronises the stream once per call. That is the price of raising on NaN/inf
// rewards and bad segment ids (a device-side assert would poison the CUDA context instead); the kernels
// leave the state and the output untouched on a bad batch, so raising afterwards is safe.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "torch_names.h"

#include <cmath>
#include <cstdint>
#include <optional>

#include "reward_norm.h"

namespace palestra {
namespace {

void check_state(const char* name, const at::Tensor& t, int64_t S, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device && t.scalar_type() == at::kDouble && t.dim() == 1 && t.numel() == S &&
                        t.is_contiguous(),
                    "normalize_rewards: ", name, " must be a contiguous float64 tensor of shape [", S, "] on ",
                    device, ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

at::Tensor normalize_rewards_cuda(const at::Tensor& rewards, const std::optional<at::Tensor>& segment_ids,
                                  at::Tensor count, at::Tensor mean, at::Tensor m2, double clip, double eps,
                                  bool update) {
  TORCH_CHECK_VALUE(rewards.is_cuda() && rewards.dim() == 1 && rewards.is_contiguous(),
                    "normalize_rewards: rewards must be a contiguous 1-D CUDA tensor, got shape ", rewards.sizes(),
                    " on ", rewards.device());
  const at::ScalarType dt = rewards.scalar_type();
  cuda::RewardDType kind;
  switch (dt) {
    case at::kFloat: kind = cuda::RewardDType::kFloat32; break;
    case at::kDouble: kind = cuda::RewardDType::kFloat64; break;
    case at::kBFloat16: kind = cuda::RewardDType::kBFloat16; break;
    case at::kHalf: kind = cuda::RewardDType::kFloat16; break;
    default:
      TORCH_CHECK_VALUE(false, "normalize_rewards: rewards has dtype ", dt,
                        ", expected float32, float64, bfloat16 or float16");
  }
  const at::Device device = rewards.device();
  const int64_t S = count.numel();
  TORCH_CHECK_VALUE(S >= 1, "normalize_rewards: count must have at least one segment, got shape ", count.sizes());
  check_state("count", count, S, device);
  check_state("mean", mean, S, device);
  check_state("m2", m2, S, device);
  TORCH_CHECK_VALUE(clip > 0.0, "normalize_rewards: clip must be > 0 (or inf for no clipping), got ", clip);
  TORCH_CHECK_VALUE(eps >= 0.0 && std::isfinite(eps), "normalize_rewards: eps must be finite and >= 0, got ", eps);
  const int64_t n = rewards.numel();
  const int64_t* seg = nullptr;
  if (segment_ids.has_value()) {
    const at::Tensor& s = *segment_ids;
    TORCH_CHECK_VALUE(s.device() == device && s.scalar_type() == at::kLong && s.dim() == 1 && s.is_contiguous() &&
                          s.numel() == n,
                      "normalize_rewards: segment_ids must be a contiguous int64 tensor of shape [", n, "] on ",
                      device, " like rewards, got ", s.scalar_type(), " ", s.sizes(), " on ", s.device());
    seg = s.data_ptr<int64_t>();
  } else {
    TORCH_CHECK_VALUE(S == 1, "normalize_rewards: segment_ids is required when the state has S=", S, " segments");
  }

  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({n}, rewards.options().dtype(at::kFloat));
  if (n == 0) return out;
  const cuda::RewardNormPlan plan = cuda::reward_norm_plan(n, S, update);
  const auto f64 = rewards.options().dtype(at::kDouble);
  const auto i64 = rewards.options().dtype(at::kLong);
  at::Tensor partials = at::empty({plan.partial_doubles > 0 ? plan.partial_doubles : 1}, f64);
  at::Tensor chunk_errors = at::empty({plan.chunk_error_slots}, i64);
  at::Tensor error_out = at::empty({4}, i64);
  at::Tensor coefficients = at::empty({2 * S}, f64);
  const cudaError_t status = cuda::launch_normalize_rewards(
      rewards.data_ptr(), kind, seg, n, S, count.data_ptr<double>(), mean.data_ptr<double>(), m2.data_ptr<double>(),
      clip, eps, update, out.data_ptr<float>(), partials.data_ptr<double>(), chunk_errors.data_ptr<int64_t>(),
      error_out.data_ptr<int64_t>(), coefficients.data_ptr<double>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "normalize_rewards: CUDA launch failed: ", cudaGetErrorString(status));

  const at::Tensor errors = error_out.cpu();  // waits for the stream: the one synchronisation
  const int64_t* e = errors.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(e[2] < 0, "normalize_rewards: segment_ids has value ", e[3], " at flat index ", e[2],
                    "; ids must lie in [0, S) with S=", S, " (the state's num_segments)");
  TORCH_CHECK_VALUE(e[0] == 0, "normalize_rewards: rewards (", dtype_name(dt), ", ", n, " elements) has ", e[0],
                    " non-finite value(s) (NaN/inf), the first at flat index ", e[1]);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(palestra, CUDA, m) {
  m.impl("normalize_rewards", &normalize_rewards_cuda);
}

}  // namespace palestra
