// Every Palestra op's schema, declared once. Device implementations live in cpu/*.cpp
// (TORCH_LIBRARY_IMPL(palestra, CPU, m)) and cuda/*_binding.cpp (TORCH_LIBRARY_IMPL(palestra, CUDA, m)).
// Python-side fake (meta) kernels and autograd formulas are registered in palestra/kernels/*.py.
//
// Conventions shared by every op (the Python wrappers in palestra.kernels enforce them, so the
// kernels can assume them):
//   * inputs are contiguous; "rows" are flattened to 2-D [N, ...] before the call;
//   * floating outputs are float32, whatever the input dtype; statistics are float64;
//   * masks are torch.bool, token ids and segment ids are int64.
#include <torch/library.h>

TORCH_LIBRARY(palestra, m) {
  // ---- log-prob gather with entropy -----------------------------------------------------------
  // logits [N, V] (f32/bf16/f16), tokens [N] int64. Returns (logp [N] f32, entropy [N] f32,
  // lse [N] f32) where z = logits / temperature, lse = logsumexp(z), logp = z[token] - lse,
  // entropy = lse - sum(softmax(z) * z). Rows whose token == ignore_index give logp = entropy = 0.
  m.def("logprob_entropy(Tensor logits, Tensor tokens, float temperature, int ignore_index) -> (Tensor, Tensor, Tensor)");
  // Gradient of the logits from the saved lse and entropy, written once, in the logits' dtype.
  m.def("logprob_entropy_backward(Tensor grad_logp, Tensor grad_entropy, Tensor logits, Tensor tokens, Tensor lse, Tensor entropy, float temperature, int ignore_index) -> Tensor");

  // ---- advantages -----------------------------------------------------------------------------
  // rewards, values [B, T] f32, mask [B, T] bool, bootstrap_value [B] f32 (value after the last valid
  // step; 0 for terminal). Padding (mask == false) may sit anywhere; it is skipped, so the
  // recursion runs over each row's valid steps only. Returns (advantages, returns), 0 at padding.
  m.def("gae(Tensor rewards, Tensor values, Tensor mask, Tensor bootstrap_value, float gamma, float lam) -> (Tensor, Tensor)");
  // rewards [B, T] f32, mask [B, T] bool. Discounted reward-to-go over valid steps, 0 at padding.
  m.def("discounted_returns(Tensor rewards, Tensor mask, float gamma) -> Tensor");
  // rewards [B] f32, B = G * group_size, groups contiguous. scale: 0 none, 1 group std, 2 batch std.
  m.def("group_advantages(Tensor rewards, int group_size, int scale, float eps) -> Tensor");
  // rewards [B] f32: reward minus the mean of the other members of its group.
  m.def("rloo_advantages(Tensor rewards, int group_size) -> Tensor");

  // ---- running reward normalisation -----------------------------------------------------------
  // rewards [N] f32, segment_ids [N] int64 in [0, S) or None (one segment); count, mean, m2 [S] f64
  // running statistics, merged in place with the batch's (Chan et al.) when update is true.
  // Returns clamp((r - mean) / sqrt(var + eps), -clip, clip) with the updated statistics.
  m.def("normalize_rewards(Tensor rewards, Tensor? segment_ids, Tensor(a!) count, Tensor(b!) mean, Tensor(c!) m2, float clip, float eps, bool update) -> Tensor");
}
