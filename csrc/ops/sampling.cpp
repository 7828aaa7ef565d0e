// Sampling the next token (temperature, top-k, top-p) from logits split by vocabulary over the
// tensor-parallel ranks, without gathering them: the local pieces (the caller does the
// collectives). The argument checks and setup (shared with the CUDA kernels in sampling_cuda.cu),
// the two device-generic ops (ATen compositions, registered for CPU and CUDA), the CPU kernels of
// the other two, and the CPU, CUDA and Autograd registrations.
//
// Rank r holds logits [B, V_r], a contiguous shard of the vocabulary. Every op sees the same
// scaled logits s = logits.to(acc) / temperature (acc: fp64 for fp64 logits, else fp32), computed
// by that exact formula (a true division, never a multiplication by the reciprocal), so s is
// bitwise the same in every op and in the Python expression `logits.to(acc) / temperature` on CPU.
// A token is kept under a threshold t when s >= t and s > -inf (-inf logits never count).
//   sampling_candidates  ([B, count] acc, [B, count] int64)  the `count` largest s of each row,
//                        descending (equal values: smaller index first), padded with (-inf, -1)
//                        past V_r
//   sampling_threshold   ([B] acc, [B] bool)  from every rank's candidates: the top-k / top-p
//                        threshold on s and whether it is final (else: retry with more candidates)
//   sampling_kept_mass   [B] acc  sum of exp(s - row_max) over this shard's kept tokens
//   sampling_pick        [B] int64  the first kept token whose running sum of exp(s - row_max)
//                        passes `target` (the last kept one if none does; -1 if none is kept)
// No derivatives (inference only): Autograd is autogradNotImplementedFallback.
#include "sampling.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "../common/checks.h"
#include "../common/dispatch.h"

namespace tp_ext::ops {

void check_sampling_logits(const at::Tensor& logits, const char* op) {
  check_logits(logits, op);
  TORCH_CHECK_VALUE(logits.dim() == 2, "tp_ext.", op, ": logits must be 2-d [batch, V_local], got ",
                    logits.dim(), "-d shape ", logits.sizes(),
                    "; flatten the leading dimensions with logits.reshape(-1, logits.shape[-1]).");
}

void check_temperature(double temperature, at::ScalarType acc, const char* op) {
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0, "tp_ext.", op,
                    ": temperature=", temperature,
                    " must be finite and > 0 (1.0 leaves the logits as they are; for greedy "
                    "decoding take the argmax instead of sampling).");
  if (acc == at::kFloat) {
    const auto as_float = static_cast<float>(temperature);
    TORCH_CHECK_VALUE(std::isfinite(as_float) && as_float > 0.0f, "tp_ext.", op,
                      ": temperature=", temperature,
                      " is not a finite positive float32 (the logits are scaled in float32); use "
                      "a value between 1e-30 and 1e30.");
  }
}

void check_row_values(const at::Tensor& x, const char* arg, int64_t rows, at::ScalarType acc,
                      const at::Device& device, const char* op) {
  TORCH_CHECK_VALUE(x.defined(), "tp_ext.", op, ": ", arg, " is an undefined tensor.");
  TORCH_CHECK_VALUE(x.layout() == at::kStrided, "tp_ext.", op, ": ", arg,
                    " must be a dense (strided) tensor, got layout ", x.layout(), ".");
  TORCH_CHECK_VALUE(x.dim() == 1 && x.size(0) == rows, "tp_ext.", op, ": ", arg, " has shape ",
                    x.sizes(), "; it must be 1-d [batch] = [", rows, "], one value per row.");
  TORCH_CHECK_VALUE(x.scalar_type() == acc, "tp_ext.", op, ": ", arg, " has dtype ",
                    x.scalar_type(), "; it must be ", acc,
                    " (the accumulation dtype: float64 for float64 logits, else float32).");
  TORCH_CHECK_VALUE(x.device() == device, "tp_ext.", op, ": ", arg, " is on ", x.device(),
                    " but the logits are on ", device, "; move both to the same device.");
}

namespace {

SamplingRowArgs prepare_rows(const at::Tensor& logits, double temperature,
                             const at::Tensor& threshold, const at::Tensor& row_max,
                             const at::Tensor* target, at::ScalarType out_dtype, const char* op) {
  check_sampling_logits(logits, op);
  const auto acc = sampling_acc_dtype(logits.scalar_type());
  check_temperature(temperature, acc, op);
  const int64_t rows = logits.size(0);
  check_row_values(threshold, "threshold", rows, acc, logits.device(), op);
  check_row_values(row_max, "row_max", rows, acc, logits.device(), op);
  if (target != nullptr) check_row_values(*target, "target", rows, acc, logits.device(), op);
  SamplingRowArgs a;
  a.logits = logits.contiguous();
  a.threshold = threshold.contiguous();
  a.row_max = row_max.contiguous();
  if (target != nullptr) a.target = target->contiguous();
  a.out = at::empty({rows}, logits.options().dtype(out_dtype));
  a.rows = rows;
  a.vocab = logits.size(1);
  return a;
}

}  // namespace

SamplingRowArgs prepare_kept_mass(const at::Tensor& logits, double temperature,
                                  const at::Tensor& threshold, const at::Tensor& row_max) {
  return prepare_rows(logits, temperature, threshold, row_max, nullptr,
                      sampling_acc_dtype(logits.scalar_type()), "sampling_kept_mass");
}

SamplingRowArgs prepare_pick(const at::Tensor& logits, double temperature,
                             const at::Tensor& threshold, const at::Tensor& row_max,
                             const at::Tensor& target) {
  return prepare_rows(logits, temperature, threshold, row_max, &target, at::kLong, "sampling_pick");
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// s = logits.to(acc) / temperature as ATen computes it for the Python expression: the division by
// a 0-d tensor on the logits' device is a true division on every device (CUDA divides by a CPU
// scalar as a multiplication by its reciprocal, which would round differently).
at::Tensor scaled_logits(const at::Tensor& logits, double temperature) {
  const auto s = logits.to(sampling_acc_dtype(logits.scalar_type()));
  return at::div(s, at::scalar_tensor(temperature, s.options())).contiguous();
}

// Device-generic (ATen): the `count` largest s per row in descending order, equal values in index
// order. fp32: one top-k of an int64 key (the order-preserving integer of s's bits above, the
// reversed column below), so the order is exact and ties are broken by index; fp64 (no room for
// the index beside 64 value bits): a stable descending sort of the row.
std::tuple<at::Tensor, at::Tensor> candidates(const at::Tensor& logits, double temperature,
                                              int64_t count) {
  const char* op = "sampling_candidates";
  check_sampling_logits(logits, op);
  const auto acc = sampling_acc_dtype(logits.scalar_type());
  check_temperature(temperature, acc, op);
  TORCH_CHECK_VALUE(count >= 1, "tp_ext.", op, ": count=", count,
                    " must be >= 1 (how many candidates each row contributes; rows of fewer "
                    "than count entries are padded with -inf and index -1).");
  const int64_t rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK_VALUE(v < (int64_t{1} << 32), "tp_ext.", op, ": a vocabulary shard of ", v,
                    " entries is too large (at most 2^32 - 1).");
  auto values = at::full({rows, count}, -kInf, logits.options().dtype(acc));
  auto indices = at::full({rows, count}, -1, logits.options().dtype(at::kLong));
  const int64_t k = std::min(count, v);
  if (rows == 0 || k == 0) return {values, indices};
  const auto s = scaled_logits(logits, temperature);
  at::Tensor picked;
  if (acc == at::kFloat) {
    // Order-preserving integer of a float: its magnitude bits, negated for negative values
    // (-0.0 and +0.0 both map to 0; NaN lands above +inf, or below -inf when negative).
    const auto bits = s.view(at::kInt);
    const auto magnitude = at::bitwise_and(bits, 0x7fffffff);
    const auto ordered = at::where(bits.lt(0), magnitude.neg(), magnitude).to(at::kLong);
    const int64_t low = (int64_t{1} << 32) - 1;  // column j -> 2^32 - 1 - j: smaller j ranks first
    const auto column = at::arange(low, low - v, -1, ordered.options());
    const auto key = ordered.mul_(int64_t{1} << 32).add_(column);
    picked = std::get<1>(at::topk(key, k, 1, /*largest=*/true, /*sorted=*/true));
  } else {
    picked = std::get<1>(at::sort(s, /*stable=*/true, 1, /*descending=*/true)).narrow(1, 0, k);
  }
  indices.narrow(1, 0, k).copy_(picked);
  values.narrow(1, 0, k).copy_(s.gather(1, picked));
  return {values, indices};
}

// Device-generic (ATen): the threshold from the candidates of every rank (the maths: the
// schema's comment in schemas.cpp and docs/ops.md).
std::tuple<at::Tensor, at::Tensor> threshold(const at::Tensor& candidates, int64_t top_k,
                                             double top_p, const at::Tensor& total_mass,
                                             const at::Tensor& row_max, int64_t exact_count) {
  const char* op = "sampling_threshold";
  TORCH_CHECK_VALUE(candidates.defined() && candidates.layout() == at::kStrided, "tp_ext.", op,
                    ": candidates must be a dense (strided) tensor.");
  const auto acc = candidates.scalar_type();
  TORCH_CHECK_VALUE(acc == at::kFloat || acc == at::kDouble, "tp_ext.", op,
                    ": candidates must be float32 or float64 (sampling_candidates' values), got ",
                    acc, ".");
  TORCH_CHECK_VALUE(candidates.dim() == 2, "tp_ext.", op, ": candidates has shape ",
                    candidates.sizes(), "; it must be 2-d [batch, N] (every rank's candidates).");
  TORCH_CHECK_VALUE(top_k >= 0, "tp_ext.", op, ": top_k=", top_k,
                    " is negative; pass top_k >= 0 (0 disables top-k).");
  TORCH_CHECK_VALUE(top_p > 0.0 && top_p <= 1.0, "tp_ext.", op, ": top_p=", top_p,
                    " is outside (0, 1]; pass 0 < top_p <= 1 (1 disables top-p).");
  TORCH_CHECK_VALUE(exact_count >= 0, "tp_ext.", op, ": exact_count=", exact_count,
                    " is negative; pass how many leading sorted candidates are the true global "
                    "order (>= 0).");
  const int64_t rows = candidates.size(0), n = candidates.size(1);
  check_row_values(total_mass, "total_mass", rows, acc, candidates.device(), op);
  check_row_values(row_max, "row_max", rows, acc, candidates.device(), op);
  const auto opts = candidates.options();
  auto resolved_all = [&] { return at::ones({rows}, opts.dtype(at::kBool)); };
  if (n == 0) return {at::full({rows}, -kInf, opts), resolved_all()};

  const auto sorted = std::get<0>(at::sort(candidates, /*stable=*/false, 1, /*descending=*/true));
  const bool top_k_cut = top_k > 0 && top_k <= n;
  auto tau = at::empty({rows}, opts);
  if (top_k_cut) {
    tau.copy_(sorted.select(1, top_k - 1));
  } else {
    tau.fill_(-kInf);
  }
  if (top_p >= 1.0) return {tau, resolved_all()};

  // Probabilities of the kept candidates (a prefix of the sorted row), in sorted order.
  const auto kept = sorted.ge(tau.unsqueeze(1)).logical_and_(sorted.gt(-kInf));
  const auto p = at::where(
      kept, at::exp(sorted - row_max.unsqueeze(1)).div_(total_mass.unsqueeze(1)), at::Scalar(0.0));
  const auto hit = at::cumsum(p, 1).ge(top_p).logical_and_(kept);
  const auto has = hit.any(1);
  const auto first = hit.to(at::kByte).argmax(1, /*keepdim=*/true);  // the first hit (or 0)
  const auto at_first = sorted.gather(1, first).squeeze(1);
  // No hit: the kept candidates are all of the kept tokens when they are the whole vocabulary, or
  // when the top-k cut (within the exact prefix) is what bounds them; the threshold is then the
  // smallest kept value. Otherwise more candidates are needed.
  const bool complete = exact_count >= n || (top_k_cut && top_k <= exact_count);
  at::Tensor threshold;
  at::Tensor resolved;
  if (complete) {
    const auto n_kept = kept.sum(1, /*keepdim=*/true);
    const auto smallest =
        at::where(n_kept.squeeze(1).gt(0), sorted.gather(1, (n_kept - 1).clamp_min_(0)).squeeze(1),
                  at::Scalar(-kInf));
    threshold = at::where(has, at_first, smallest);
    resolved = at::where(has, first.squeeze(1).lt(exact_count), at::Scalar(true));
  } else {
    threshold = at::where(has, at_first, at::Scalar(-kInf));
    resolved = has.logical_and(first.squeeze(1).lt(exact_count));
  }
  return {threshold.contiguous(), resolved.contiguous()};
}

// Rows per parallel chunk: enough that a chunk covers ~32k logits.
int64_t grain(int64_t vocab) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(vocab, 1)); }

template <typename acc_t>
inline bool is_kept(acc_t s, acc_t threshold) {
  return s >= threshold && s > -std::numeric_limits<acc_t>::infinity();
}

at::Tensor kept_mass_cpu(const at::Tensor& logits, double temperature, const at::Tensor& threshold,
                         const at::Tensor& row_max) {
  auto a = prepare_kept_mass(logits, temperature, threshold, row_max);
  TP_EXT_DISPATCH_FLOATING_TYPES(a.logits.scalar_type(), "sampling_kept_mass", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* l = a.logits.const_data_ptr<scalar_t>();
    const acc_t* th = a.threshold.const_data_ptr<acc_t>();
    const acc_t* mx = a.row_max.const_data_ptr<acc_t>();
    acc_t* o = a.out.data_ptr<acc_t>();
    const acc_t t = static_cast<acc_t>(temperature);
    const int64_t v = a.vocab;
    at::parallel_for(0, a.rows, grain(v), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* row = l + b * v;
        const acc_t cut = th[b], m = mx[b];
        acc_t sum = 0;
        for (int64_t i = 0; i < v; ++i) {
          const acc_t s = static_cast<acc_t>(row[i]) / t;
          if (is_kept(s, cut)) sum += std::exp(s - m);
        }
        o[b] = sum;
      }
    });
  });
  return a.out;
}

at::Tensor pick_cpu(const at::Tensor& logits, double temperature, const at::Tensor& threshold,
                    const at::Tensor& row_max, const at::Tensor& target) {
  auto a = prepare_pick(logits, temperature, threshold, row_max, target);
  TP_EXT_DISPATCH_FLOATING_TYPES(a.logits.scalar_type(), "sampling_pick", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* l = a.logits.const_data_ptr<scalar_t>();
    const acc_t* th = a.threshold.const_data_ptr<acc_t>();
    const acc_t* mx = a.row_max.const_data_ptr<acc_t>();
    const acc_t* tg = a.target.const_data_ptr<acc_t>();
    int64_t* o = a.out.data_ptr<int64_t>();
    const acc_t t = static_cast<acc_t>(temperature);
    const int64_t v = a.vocab;
    at::parallel_for(0, a.rows, grain(v), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* row = l + b * v;
        const acc_t cut = th[b], m = mx[b], goal = tg[b];
        acc_t running = 0;
        int64_t last = -1;  // the last kept token so far: the answer when target is never passed
        for (int64_t i = 0; i < v; ++i) {
          const acc_t s = static_cast<acc_t>(row[i]) / t;
          if (!is_kept(s, cut)) continue;
          running += std::exp(s - m);
          last = i;
          if (running > goal) break;
        }
        o[b] = last;
      }
    });
  });
  return a.out;
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("sampling_candidates", &tp_ext::ops::candidates);
  m.impl("sampling_threshold", &tp_ext::ops::threshold);
  m.impl("sampling_kept_mass", &tp_ext::ops::kept_mass_cpu);
  m.impl("sampling_pick", &tp_ext::ops::pick_cpu);
}

// ATen compositions: the same code serves CUDA tensors (kept_mass and pick: sampling_cuda.cu).
TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("sampling_candidates", &tp_ext::ops::candidates);
  m.impl("sampling_threshold", &tp_ext::ops::threshold);
}

// Inference only: no derivatives. Inputs that require grad are fine; asking for a gradient of the
// values (the only differentiable outputs) raises "not implemented" at backward time.
TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  for (const char* name :
       {"sampling_candidates", "sampling_threshold", "sampling_kept_mass", "sampling_pick"})
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
}
