// CPU kernels for the advantage estimators (schemas in ../ops.cpp).
//
// gae / discounted_returns: at::parallel_for over rows, one sequential reverse scan per row. A row is
// contiguous along T, so the scan streams it once. The recursion is carried in double: on a CPU the
// scan is bound by the latency of its one multiply-add per step, which is the same for double and
// float, and double keeps the result exact (to fp32 rounding of the output) at any T, even with
// gamma * lam close to 1, where a float carry drifts (gamma * lam itself is not representable).
// Rows are scanned two at a time in lockstep so that two independent dependency chains overlap (more
// rows per pass measured slower: register pressure, and 4 KiB aliasing between rows when T is a power of 2).
//
// group_advantages / rloo_advantages: per group, a two-pass mean / sum of squared deviations in
// double (exact enough for any group size, no catastrophic cancellation).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace palestra {
namespace {

void check_cpu(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_shape(const at::Tensor& t, const char* op, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " has shape ", t.sizes(), ", expected ", shape);
}

// One reverse scan over L rows in lockstep (L independent dependency chains for the core to overlap).
// State per row while walking back in time: A = advantage of the next valid step (0 past the end),
// N = value of the next valid step (the bootstrap value past the end). A padding step (mask false)
// leaves both untouched and writes 0, so the recursion runs over the valid steps only.
// With kValues == false this is the discounted reward-to-go (values 0, bootstrap 0, c = gamma).
template <int L, bool kValues>
inline void scan_rows(const float* const* r, const float* const* v, const bool* const* m, const double* boot,
                      double gamma, double c, int64_t T, float* const* adv, float* const* ret) {
  double A[L], N[L];
  for (int i = 0; i < L; ++i) {
    A[i] = 0.0;
    N[i] = kValues ? boot[i] : 0.0;
  }
  for (int64_t t = T - 1; t >= 0; --t) {
    for (int i = 0; i < L; ++i) {
      const double vt = kValues ? static_cast<double>(v[i][t]) : 0.0;
      // delta_t + c * A_{t+1}, where delta_t = r_t + gamma * V(next valid) - V_t
      const double a = (static_cast<double>(r[i][t]) - vt + gamma * N[i]) + c * A[i];
      const bool valid = m[i][t];
      A[i] = valid ? a : A[i];
      if (kValues) N[i] = valid ? vt : N[i];
      adv[i][t] = valid ? static_cast<float>(a) : 0.0f;
      if (kValues) ret[i][t] = valid ? static_cast<float>(a + vt) : 0.0f;
    }
  }
}

template <bool kValues>
void scan_all(const float* r, const float* v, const bool* m, const float* boot, double gamma, double c,
              int64_t B, int64_t T, float* adv, float* ret) {
  constexpr int L = 2;
  // A chunk of rows per task: enough work (~64k steps) to amortise the thread hand-off.
  const int64_t grain = std::max<int64_t>(L, (int64_t{1} << 16) / std::max<int64_t>(T, 1));
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    int64_t b = begin;
    for (; b + L <= end; b += L) {
      const float* rp[L];
      const float* vp[L];
      const bool* mp[L];
      float* ap[L];
      float* op[L];
      double bv[L];
      for (int i = 0; i < L; ++i) {
        rp[i] = r + (b + i) * T;
        vp[i] = kValues ? v + (b + i) * T : nullptr;
        mp[i] = m + (b + i) * T;
        ap[i] = adv + (b + i) * T;
        op[i] = kValues ? ret + (b + i) * T : nullptr;
        bv[i] = kValues ? static_cast<double>(boot[b + i]) : 0.0;
      }
      scan_rows<L, kValues>(rp, vp, mp, bv, gamma, c, T, ap, op);
    }
    for (; b < end; ++b) {
      const float* rp[1] = {r + b * T};
      const float* vp[1] = {kValues ? v + b * T : nullptr};
      const bool* mp[1] = {m + b * T};
      float* ap[1] = {adv + b * T};
      float* op[1] = {kValues ? ret + b * T : nullptr};
      double bv[1] = {kValues ? static_cast<double>(boot[b]) : 0.0};
      scan_rows<1, kValues>(rp, vp, mp, bv, gamma, c, T, ap, op);
    }
  });
}

void check_discount(const char* op, double gamma, double lam) {
  TORCH_CHECK(gamma >= 0.0 && gamma <= 1.0, op, ": gamma must be in [0, 1], got ", gamma);
  TORCH_CHECK(lam >= 0.0 && lam <= 1.0, op, ": lam must be in [0, 1], got ", lam);
}

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                                           const at::Tensor& bootstrap_value, double gamma, double lam) {
  constexpr const char* op = "gae";
  TORCH_CHECK(rewards.dim() == 2, op, ": rewards has shape ", rewards.sizes(), ", expected [B, T]");
  const int64_t B = rewards.size(0), T = rewards.size(1);
  check_cpu(rewards, op, "rewards", at::kFloat);
  check_cpu(values, op, "values", at::kFloat);
  check_cpu(mask, op, "mask", at::kBool);
  check_cpu(bootstrap_value, op, "bootstrap_value", at::kFloat);
  check_shape(values, op, "values", rewards.sizes());
  check_shape(mask, op, "mask", rewards.sizes());
  check_shape(bootstrap_value, op, "bootstrap_value", {B});
  check_discount(op, gamma, lam);
  auto adv = at::empty({B, T}, rewards.options());
  auto ret = at::empty({B, T}, rewards.options());
  scan_all<true>(rewards.const_data_ptr<float>(), values.const_data_ptr<float>(), mask.const_data_ptr<bool>(),
                 bootstrap_value.const_data_ptr<float>(), gamma, gamma * lam, B, T, adv.mutable_data_ptr<float>(),
                 ret.mutable_data_ptr<float>());
  return {adv, ret};
}

at::Tensor discounted_returns_cpu(const at::Tensor& rewards, const at::Tensor& mask, double gamma) {
  constexpr const char* op = "discounted_returns";
  TORCH_CHECK(rewards.dim() == 2, op, ": rewards has shape ", rewards.sizes(), ", expected [B, T]");
  const int64_t B = rewards.size(0), T = rewards.size(1);
  check_cpu(rewards, op, "rewards", at::kFloat);
  check_cpu(mask, op, "mask", at::kBool);
  check_shape(mask, op, "mask", rewards.sizes());
  check_discount(op, gamma, 1.0);
  auto out = at::empty({B, T}, rewards.options());
  scan_all<false>(rewards.const_data_ptr<float>(), nullptr, mask.const_data_ptr<bool>(), nullptr, gamma, gamma, B, T,
                  out.mutable_data_ptr<float>(), nullptr);
  return out;
}

// Sums in double with four independent partial sums: a single running sum is one long chain of
// dependent additions (latency-bound); four chains overlap and vectorise.
inline double sum_of(const float* x, int64_t n) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += x[i];
    s1 += x[i + 1];
    s2 += x[i + 2];
    s3 += x[i + 3];
  }
  for (; i < n; ++i) s0 += x[i];
  return (s0 + s1) + (s2 + s3);
}

inline double mean_of(const float* x, int64_t n) { return n > 0 ? sum_of(x, n) / static_cast<double>(n) : 0.0; }

// Unbiased variance (0 for a single element) around a known mean, in double.
inline double var_around(const float* x, int64_t n, double mean) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const double d0 = x[i] - mean, d1 = x[i + 1] - mean, d2 = x[i + 2] - mean, d3 = x[i + 3] - mean;
    s0 += d0 * d0;
    s1 += d1 * d1;
    s2 += d2 * d2;
    s3 += d3 * d3;
  }
  for (; i < n; ++i) {
    const double d = x[i] - mean;
    s0 += d * d;
  }
  return n > 1 ? ((s0 + s1) + (s2 + s3)) / static_cast<double>(n - 1) : 0.0;
}

// Groups per task: ~64k rewards, so that batches of a few thousand rewards stay on one thread
// (a parallel region costs more than the whole op there).
inline int64_t group_grain(int64_t group_size) { return std::max<int64_t>(1, (int64_t{1} << 16) / group_size); }

void check_groups(const char* op, const at::Tensor& rewards, int64_t group_size, int64_t min_size) {
  check_cpu(rewards, op, "rewards", at::kFloat);
  TORCH_CHECK(rewards.dim() == 1, op, ": rewards has shape ", rewards.sizes(), ", expected [B]");
  TORCH_CHECK(group_size >= min_size, op, ": group_size must be >= ", min_size, ", got ", group_size);
  TORCH_CHECK(rewards.size(0) % group_size == 0, op, ": group_size ", group_size,
              " does not divide the batch size ", rewards.size(0));
}

at::Tensor group_advantages_cpu(const at::Tensor& rewards, int64_t group_size, int64_t scale, double eps) {
  constexpr const char* op = "group_advantages";
  check_groups(op, rewards, group_size, 1);
  TORCH_CHECK(scale >= 0 && scale <= 2, op, ": scale must be 0 (none), 1 (group) or 2 (batch), got ", scale);
  const int64_t B = rewards.size(0);
  const int64_t G = B / group_size;
  const float* r = rewards.const_data_ptr<float>();
  auto out = at::empty_like(rewards);
  float* o = out.mutable_data_ptr<float>();
  double batch_denom = 1.0;
  if (scale == 2) batch_denom = std::sqrt(var_around(r, B, mean_of(r, B))) + eps;
  at::parallel_for(0, G, group_grain(group_size), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* x = r + g * group_size;
      float* y = o + g * group_size;
      const double mean = mean_of(x, group_size);
      if (scale == 0) {
        for (int64_t i = 0; i < group_size; ++i) y[i] = static_cast<float>(x[i] - mean);
        continue;
      }
      const double denom = scale == 1 ? std::sqrt(var_around(x, group_size, mean)) + eps : batch_denom;
      const double inv = 1.0 / denom;  // a multiply per element instead of a (much slower) divide
      for (int64_t i = 0; i < group_size; ++i) y[i] = static_cast<float>((x[i] - mean) * inv);
    }
  });
  return out;
}

at::Tensor rloo_advantages_cpu(const at::Tensor& rewards, int64_t group_size) {
  constexpr const char* op = "rloo_advantages";
  check_groups(op, rewards, group_size, 2);
  const int64_t G = rewards.size(0) / group_size;
  const float* r = rewards.const_data_ptr<float>();
  auto out = at::empty_like(rewards);
  float* o = out.mutable_data_ptr<float>();
  // r_i - (sum - r_i) / (k - 1) == k / (k - 1) * (r_i - mean): one subtraction of nearby numbers only.
  const double k = static_cast<double>(group_size);
  const double factor = k / (k - 1.0);
  at::parallel_for(0, G, group_grain(group_size), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* x = r + g * group_size;
      float* y = o + g * group_size;
      const double mean = mean_of(x, group_size);
      for (int64_t i = 0; i < group_size; ++i) y[i] = static_cast<float>(factor * (x[i] - mean));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(palestra, CPU, m) {
  m.impl("gae", &gae_cpu);
  m.impl("discounted_returns", &discounted_returns_cpu);
  m.impl("group_advantages", &group_advantages_cpu);
  m.impl("rloo_advantages", &rloo_advantages_cpu);
}

}  // namespace palestra
