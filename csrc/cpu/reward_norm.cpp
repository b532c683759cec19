// Fused running reward normalisation, CPU back end.
//
// One call does three things, in this order, without leaving C++:
//   1. batch moments: per-segment (count, mean, M2) of the rewards, in float64;
//   2. the merge: Chan et al.'s parallel formula folds the batch moments into the running state
//      (count, mean, m2) in place (only when `update` is true);
//   3. the write: out = clamp((r - mean_s) * (1 / sqrt(var_s + eps)), -clip, clip), in float32
//      (float64 for float64 rewards), with the updated statistics.
//
// Numerics of step 1. Naive sum / sum-of-squares loses the variance to cancellation when the mean is
// large against the spread, so each block of kBlock elements (cache-resident) gets an exact two-pass
// mean and M2, and blocks are folded together with Chan's merge; chunks of blocks are merged the same way.
// The result is as good as Welford's per-element update, but vectorises (no division per element).
// With segments, the per-block moments come from masked passes (S <= 4) or a scatter into per-segment
// accumulators (more segments); see chunk_moments_dense and chunk_moments_segmented.
//
// Determinism. The rewards are cut into chunks whose number depends only on N and S, never on the
// thread count; at::parallel_for hands chunks to threads and each chunk writes its own partials, which
// are merged in chunk order afterwards. The statistics are therefore bitwise identical for any number
// of threads.
//
// Errors (a segment id outside [0, S), a NaN/inf reward) are detected inside the same passes and raised
// as one-line ValueErrors after them, before the state is touched.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "torch_names.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace palestra {
namespace {

// Elements per exact two-pass block: 16 KiB of float32, so the second pass reads from L1.
constexpr int64_t kBlock = 4096;
// Elements per chunk (unit of parallel work). Fixed, so the partition does not depend on threads.
constexpr int64_t kChunk = 16 * 1024;
// Upper bound on chunk partial entries (chunks x segments), to bound the workspace for large S.
constexpr int64_t kMaxPartials = int64_t{1} << 20;
// Segment-id accumulators are kept in this many interleaved banks (element i uses bank i % kBanks),
// which breaks the store-to-load dependency when neighbouring elements share a segment.
constexpr int64_t kBanks = 4;

// What one chunk saw that is wrong with the input.
struct ChunkErrors {
  int64_t nonfinite = 0;        // how many NaN/inf rewards
  int64_t first_nonfinite = -1; // flat index of the first one
  int64_t first_bad_id = -1;    // flat index of the first segment id outside [0, S)
  int64_t bad_id_value = 0;     // its value
};

inline void chan_merge(double& n_a, double& mean_a, double& m2_a, double n_b, double mean_b, double m2_b) {
  if (n_b == 0.0) return;
  const double n = n_a + n_b;
  const double delta = mean_b - mean_a;
  mean_a = mean_a + delta * (n_b / n);
  m2_a = m2_a + m2_b + delta * delta * (n_a * n_b / n);
  n_a = n;
}

template <typename T>
inline float as_float(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline double as_double(T v) {
  return static_cast<double>(static_cast<float>(v));
}
template <>
inline double as_double<double>(double v) {
  return v;
}

template <typename T>
void scan_nonfinite(const T* x, int64_t begin, int64_t end, ChunkErrors& err) {
  for (int64_t i = begin; i < end; ++i) {
    if (!std::isfinite(as_double(x[i]))) {
      if (err.first_nonfinite < 0) err.first_nonfinite = i;
      ++err.nonfinite;
    }
  }
}

// The chunk partition: a function of N and S alone.
struct Partition {
  int64_t chunks;
  int64_t size;
};

Partition partition(int64_t n, int64_t num_segments) {
  int64_t chunks = std::max<int64_t>(1, (n + kChunk - 1) / kChunk);
  chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, kMaxPartials / num_segments));
  const int64_t size = (n + chunks - 1) / chunks;
  return {std::max<int64_t>(1, (n + size - 1) / size), size};
}

// ---- step 1, one segment ---------------------------------------------------------------------
template <typename T>
void chunk_moments_single(const T* x, int64_t begin, int64_t end, double* part, ChunkErrors& err) {
  double n_acc = 0.0, mean_acc = 0.0, m2_acc = 0.0;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t e = std::min(end, b + kBlock);
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = b; i < e; ++i) sum += as_double(x[i]);
    if (!std::isfinite(sum)) {
      // A NaN/inf reward (or, for float64 input, an overflowing sum): find and count the culprits.
      scan_nonfinite(x, b, e, err);
      if (err.nonfinite > 0) continue;
    }
    const double len = static_cast<double>(e - b);
    const double block_mean = sum / len;
    double m2 = 0.0;
#pragma omp simd reduction(+ : m2)
    for (int64_t i = b; i < e; ++i) {
      const double d = as_double(x[i]) - block_mean;
      m2 += d * d;
    }
    chan_merge(n_acc, mean_acc, m2_acc, len, block_mean, m2);
  }
  part[0] = n_acc;
  part[1] = mean_acc;
  part[2] = m2_acc;
}

// ---- step 1, a few segments -------------------------------------------------------------------
// Up to kDenseSegments segments: per block, one masked pass per segment for the counts and sums, and one
// per segment for the squared deviations. The mask multiplies (a select would compile to a branch that
// random ids mispredict), so every pass is a branch-free reduction that vectorises, and the block stays in
// L1 across passes: this beats a scatter per element up to about 4 segments (measured on AVX-512).
// A NaN/inf outside segment s still poisons s's sum (0 * inf = NaN), which only matters for detection:
// any non-finite sum sends the block to scan_nonfinite, which counts exactly.
constexpr int64_t kDenseSegments = 4;

template <typename T>
void chunk_moments_dense(const T* x, const int64_t* seg, int64_t S, int64_t begin, int64_t end, double* part,
                         ChunkErrors& err) {
  double* p_n = part;
  double* p_mean = part + S;
  double* p_m2 = part + 2 * S;
  const uint64_t uS = static_cast<uint64_t>(S);
  double block_n[kDenseSegments], block_mean[kDenseSegments];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t e = std::min(end, b + kBlock);
    int bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = b; i < e; ++i) bad |= static_cast<int>(static_cast<uint64_t>(seg[i]) >= uS);
    if (bad) {
      for (int64_t i = b; i < e && err.first_bad_id < 0; ++i) {
        if (static_cast<uint64_t>(seg[i]) >= uS) {
          err.first_bad_id = i;
          err.bad_id_value = seg[i];
        }
      }
      continue;  // a bad id is the error reported; this chunk's statistics will not be used
    }
    bool finite = true;
    for (int64_t s = 0; s < S; ++s) {
      double n = 0.0, sum = 0.0;
#pragma omp simd reduction(+ : n, sum)
      for (int64_t i = b; i < e; ++i) {
        const double hit = static_cast<double>(seg[i] == s);
        n += hit;
        sum += hit * as_double(x[i]);
      }
      block_n[s] = n;
      block_mean[s] = n > 0.0 ? sum / n : 0.0;
      finite = finite && std::isfinite(sum);
    }
    if (!finite) scan_nonfinite(x, b, e, err);
    if (err.nonfinite > 0 || err.first_bad_id >= 0) continue;
    for (int64_t s = 0; s < S; ++s) {
      if (block_n[s] == 0.0) continue;
      const double mean = block_mean[s];
      double m2 = 0.0;
#pragma omp simd reduction(+ : m2)
      for (int64_t i = b; i < e; ++i) {
        const double d = static_cast<double>(seg[i] == s) * (as_double(x[i]) - mean);  // finite here
        m2 += d * d;
      }
      chan_merge(p_n[s], p_mean[s], p_m2[s], block_n[s], mean, m2);
    }
  }
}

// ---- step 1, many segments -------------------------------------------------------------------
// Accumulators of one segment in one bank, on one cache half-line: pass 1 fills count and sum, pass 2 m2.
struct SegmentAcc {
  double n, sum, m2, pad;
};

// Elements per two-pass block when segmented: at least ~16 per segment, so the per-block merge of each
// touched segment stays cheap next to the per-element work, and at most 32K (x and ids stay in L2).
int64_t segmented_block(int64_t S) {
  return std::min<int64_t>(std::max<int64_t>(kBlock, 16 * S), 32 * 1024);
}

// Up to this many segments, a block's present segments are found by scanning all S counts (the block holds
// at least 16 elements per segment, so that costs under 1/16 of the per-element work).
constexpr int64_t kUntrackedSegments = 2048;

// Per-thread workspace for the segmented block pass.
struct SegmentScratch {
  int64_t banks;
  std::vector<SegmentAcc> acc;     // [banks * S]
  std::vector<double> block_mean;  // [S]
  std::vector<uint8_t> seen;       // [S]: segment present in the current block
  std::vector<int64_t> touched;    // segments present in the current block, in first-seen order

  explicit SegmentScratch(int64_t S)
      : banks(S <= 8192 ? kBanks : 1),
        acc(banks * S, SegmentAcc{0.0, 0.0, 0.0, 0.0}),
        block_mean(S, 0.0),
        seen(S, 0) {
    touched.reserve(std::min<int64_t>(S, segmented_block(S)));
  }
};

// kTrack: record the segments present as they appear (many segments), rather than scanning all S of them
// after the block's first pass (few segments, where the per-element bookkeeping costs more than the scan).
template <bool kTrack, typename T>
void chunk_moments_segmented(const T* x, const int64_t* seg, int64_t S, int64_t begin, int64_t end, double* part,
                             SegmentScratch& w, ChunkErrors& err) {
  // part: [3, S] (count row, mean row, m2 row) for this chunk, zero on entry.
  double* p_n = part;
  double* p_mean = part + S;
  double* p_m2 = part + 2 * S;
  const int64_t banks = w.banks;
  const int64_t bank_mask = banks - 1;  // banks is a power of two
  const uint64_t uS = static_cast<uint64_t>(S);
  const int64_t block = segmented_block(S);
  SegmentAcc* acc = w.acc.data();
  for (int64_t b = begin; b < end; b += block) {
    const int64_t e = std::min(end, b + block);
    // Pass 1: per-segment counts and sums.
    for (int64_t i = b; i < e; ++i) {
      const int64_t s = seg[i];
      if (static_cast<uint64_t>(s) >= uS) {
        if (err.first_bad_id < 0) {
          err.first_bad_id = i;
          err.bad_id_value = s;
        }
        continue;
      }
      if (kTrack && !w.seen[s]) {
        w.seen[s] = 1;
        w.touched.push_back(s);
      }
      SegmentAcc& a = acc[(i & bank_mask) * S + s];
      a.n += 1.0;
      a.sum += as_double(x[i]);
    }
    if (!kTrack) {  // few segments: find the present ones by their counts, once per block
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t k = 0; k < banks; ++k) {
          if (acc[k * S + s].n > 0.0) {
            w.touched.push_back(s);
            break;
          }
        }
      }
    }
    bool finite = true;
    for (const int64_t s : w.touched) {
      double n = 0.0, sum = 0.0;
      for (int64_t k = 0; k < banks; ++k) {
        n += acc[k * S + s].n;
        sum += acc[k * S + s].sum;
      }
      acc[s].n = n;  // bank 0 now holds the block's count
      w.block_mean[s] = sum / n;
      finite = finite && std::isfinite(sum);
    }
    if (!finite) scan_nonfinite(x, b, e, err);
    if (err.nonfinite == 0 && err.first_bad_id < 0) {
      // Pass 2: per-segment squared deviations from the block mean.
      const double* block_mean = w.block_mean.data();
      for (int64_t i = b; i < e; ++i) {
        const int64_t s = seg[i];
        const double d = as_double(x[i]) - block_mean[s];
        acc[(i & bank_mask) * S + s].m2 += d * d;
      }
      for (const int64_t s : w.touched) {
        double m2 = 0.0;
        for (int64_t k = 0; k < banks; ++k) m2 += acc[k * S + s].m2;
        chan_merge(p_n[s], p_mean[s], p_m2[s], acc[s].n, w.block_mean[s], m2);
      }
    }
    for (const int64_t s : w.touched) {
      for (int64_t k = 0; k < banks; ++k) acc[k * S + s] = SegmentAcc{0.0, 0.0, 0.0, 0.0};
      w.seen[s] = 0;
    }
    w.touched.clear();
  }
}

// ---- step 3 ------------------------------------------------------------------------------------
// Compute type of the write pass: float32, or float64 for float64 rewards.
template <typename T>
struct WriteMath {
  using type = float;
};
template <>
struct WriteMath<double> {
  using type = double;
};

template <typename T>
void write_chunk(const T* x, const int64_t* seg, int64_t S, int64_t begin, int64_t end,
                 const typename WriteMath<T>::type* shift, const typename WriteMath<T>::type* scale, double clip,
                 bool check, float* out, ChunkErrors& err) {
  using M = typename WriteMath<T>::type;
  const M hi = static_cast<M>(clip);
  const M lo = -hi;
  if (seg == nullptr) {
    const M m = shift[0];
    const M sc = scale[0];
    if (check) {
      // update=false skips step 1, so the input is checked here: x * 0 is NaN exactly when x is NaN/inf.
      M probe = 0;
#pragma omp simd reduction(+ : probe)
      for (int64_t i = begin; i < end; ++i) probe += static_cast<M>(x[i]) * M(0);
      if (!std::isfinite(probe)) scan_nonfinite(x, begin, end, err);
    }
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const M y = (static_cast<M>(x[i]) - m) * sc;
      out[i] = static_cast<float>(std::min(std::max(y, lo), hi));
    }
    return;
  }
  // Out-of-range ids read segment 0 and write 0 here (branch-free, so the loop vectorises with gathers);
  // they are reported after the loop. Only reachable with update=false: step 1 checked them otherwise.
  const uint64_t uS = static_cast<uint64_t>(S);
  M probe = 0;
  int any_bad = 0;
#pragma omp simd reduction(+ : probe) reduction(| : any_bad)
  for (int64_t i = begin; i < end; ++i) {
    const int64_t s = seg[i];
    const bool ok = static_cast<uint64_t>(s) < uS;
    any_bad |= static_cast<int>(!ok);
    const int64_t k = ok ? s : 0;
    const M v = static_cast<M>(x[i]);
    probe += v * M(0);
    const M y = std::min(std::max((v - shift[k]) * scale[k], lo), hi);
    out[i] = ok ? static_cast<float>(y) : 0.0f;
  }
  if (any_bad) {
    for (int64_t i = begin; i < end; ++i) {
      if (static_cast<uint64_t>(seg[i]) >= uS) {
        if (err.first_bad_id < 0) {
          err.first_bad_id = i;
          err.bad_id_value = seg[i];
        }
        break;
      }
    }
  }
  if (check && !std::isfinite(probe)) scan_nonfinite(x, begin, end, err);
}

ChunkErrors reduce_errors(const std::vector<ChunkErrors>& errs) {
  ChunkErrors total;
  for (const ChunkErrors& e : errs) {  // chunk order = index order, so "first" is the global first
    total.nonfinite += e.nonfinite;
    if (total.first_nonfinite < 0) total.first_nonfinite = e.first_nonfinite;
    if (total.first_bad_id < 0 && e.first_bad_id >= 0) {
      total.first_bad_id = e.first_bad_id;
      total.bad_id_value = e.bad_id_value;
    }
  }
  return total;
}

// The one-line messages; palestra/kernels/reward_norm.py words the torch and Triton back ends' alike.
void raise_errors(const ChunkErrors& e, int64_t S, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(e.first_bad_id < 0, "normalize_rewards: segment_ids has value ", e.bad_id_value,
                    " at flat index ", e.first_bad_id, "; ids must lie in [0, S) with S=", S,
                    " (the state's num_segments)");
  TORCH_CHECK_VALUE(e.nonfinite == 0, "normalize_rewards: rewards (", dtype_name(dtype), ", ", n, " elements) has ",
                    e.nonfinite, " non-finite value(s) (NaN/inf), the first at flat index ", e.first_nonfinite);
}

template <typename T>
at::Tensor normalize_typed(const at::Tensor& rewards, const int64_t* seg, at::Tensor& count, at::Tensor& mean,
                           at::Tensor& m2, double clip, double eps, bool update) {
  using M = typename WriteMath<T>::type;
  const int64_t n = rewards.numel();
  const int64_t S = count.numel();
  const T* x = rewards.data_ptr<T>();
  double* st_n = count.data_ptr<double>();
  double* st_mean = mean.data_ptr<double>();
  double* st_m2 = m2.data_ptr<double>();
  at::Tensor out = at::empty({n}, rewards.options().dtype(at::kFloat));
  if (n == 0) return out;
  const Partition part = partition(n, S);

  if (update) {
    // Step 1: per-chunk partials, [chunk][3][S].
    std::vector<double> partials(static_cast<size_t>(part.chunks * 3 * S), 0.0);
    std::vector<ChunkErrors> errs(part.chunks);
    at::parallel_for(0, part.chunks, 1, [&](int64_t c0, int64_t c1) {
      if (seg == nullptr) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b = c * part.size, e = std::min(n, b + part.size);
          double* p = partials.data() + c * 3;  // S == 1: [n, mean, m2]
          chunk_moments_single(x, b, e, p, errs[c]);
        }
      } else if (S <= kDenseSegments) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b = c * part.size, e = std::min(n, b + part.size);
          chunk_moments_dense(x, seg, S, b, e, partials.data() + c * 3 * S, errs[c]);
        }
      } else {
        SegmentScratch scratch(S);
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t b = c * part.size, e = std::min(n, b + part.size);
          double* p = partials.data() + c * 3 * S;
          if (S <= kUntrackedSegments) {
            chunk_moments_segmented<false>(x, seg, S, b, e, p, scratch, errs[c]);
          } else {
            chunk_moments_segmented<true>(x, seg, S, b, e, p, scratch, errs[c]);
          }
        }
      }
    });
    raise_errors(reduce_errors(errs), S, n, rewards.scalar_type());
    // Step 2: fold the chunks into the batch moments, in chunk order, then the batch into the state.
    at::parallel_for(0, S, 2048, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        double bn = 0.0, bmean = 0.0, bm2 = 0.0;
        for (int64_t c = 0; c < part.chunks; ++c) {
          const double* p = partials.data() + c * 3 * S;
          chan_merge(bn, bmean, bm2, p[s], p[S + s], p[2 * S + s]);
        }
        chan_merge(st_n[s], st_mean[s], st_m2[s], bn, bmean, bm2);
      }
    });
  }

  // Step 3: per-segment shift and scale, then the write.
  std::vector<M> shift(S), scale(S);
  for (int64_t s = 0; s < S; ++s) {
    if (st_n[s] > 0.0) {
      shift[s] = static_cast<M>(st_mean[s]);
      scale[s] = static_cast<M>(1.0 / std::sqrt(st_m2[s] / st_n[s] + eps));
    } else {  // no sample yet: the rewards pass through, clipped
      shift[s] = M(0);
      scale[s] = M(1);
    }
  }
  float* y = out.data_ptr<float>();
  std::vector<ChunkErrors> errs(part.chunks);
  at::parallel_for(0, part.chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * part.size, e = std::min(n, b + part.size);
      write_chunk(x, seg, S, b, e, shift.data(), scale.data(), clip, !update, y, errs[c]);
    }
  });
  if (!update) raise_errors(reduce_errors(errs), S, n, rewards.scalar_type());
  return out;
}

void check_state(const char* name, const at::Tensor& t, int64_t S) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kDouble && t.dim() == 1 && t.numel() == S &&
                        t.is_contiguous(),
                    "normalize_rewards: ", name, " must be a contiguous float64 CPU tensor of shape [", S,
                    "], got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

at::Tensor normalize_rewards_cpu(const at::Tensor& rewards, const std::optional<at::Tensor>& segment_ids,
                                 at::Tensor count, at::Tensor mean, at::Tensor m2, double clip, double eps,
                                 bool update) {
  TORCH_CHECK_VALUE(rewards.dim() == 1 && rewards.is_contiguous(),
                    "normalize_rewards: rewards must be a contiguous 1-D tensor, got shape ", rewards.sizes());
  const at::ScalarType dt = rewards.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
                    "normalize_rewards: rewards has dtype ", dt, ", expected float32, float64, bfloat16 or float16");
  const int64_t S = count.numel();
  TORCH_CHECK_VALUE(S >= 1, "normalize_rewards: count must have at least one segment, got shape ", count.sizes());
  check_state("count", count, S);
  check_state("mean", mean, S);
  check_state("m2", m2, S);
  TORCH_CHECK_VALUE(clip > 0.0, "normalize_rewards: clip must be > 0 (or inf for no clipping), got ", clip);
  TORCH_CHECK_VALUE(eps >= 0.0 && std::isfinite(eps), "normalize_rewards: eps must be finite and >= 0, got ", eps);
  const int64_t* seg = nullptr;
  if (segment_ids.has_value()) {
    const at::Tensor& s = *segment_ids;
    TORCH_CHECK_VALUE(s.scalar_type() == at::kLong && s.dim() == 1 && s.is_contiguous() &&
                          s.numel() == rewards.numel() && s.device().is_cpu(),
                      "normalize_rewards: segment_ids must be a contiguous int64 CPU tensor of shape [",
                      rewards.numel(), "] like rewards, got ", s.scalar_type(), " ", s.sizes());
    seg = s.data_ptr<int64_t>();
  } else {
    TORCH_CHECK_VALUE(S == 1, "normalize_rewards: segment_ids is required when the state has S=", S, " segments");
  }
  switch (dt) {
    case at::kFloat: return normalize_typed<float>(rewards, seg, count, mean, m2, clip, eps, update);
    case at::kDouble: return normalize_typed<double>(rewards, seg, count, mean, m2, clip, eps, update);
    case at::kBFloat16: return normalize_typed<c10::BFloat16>(rewards, seg, count, mean, m2, clip, eps, update);
    default: return normalize_typed<c10::Half>(rewards, seg, count, mean, m2, clip, eps, update);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(palestra, CPU, m) {
  m.impl("normalize_rewards", &normalize_rewards_cpu);
}

}  // namespace palestra
