// CPU kernels of the local (non-communicating) pieces of tp_ext.vocab_parallel_cross_entropy, their
// argument checks and setup (shared with the CUDA kernels in vocab_cross_entropy_cuda.cu) and their
// registration at the CPU and Autograd keys.
//
// Rank r holds logits[..., V_r]: vocabulary entries [vocab_start, vocab_start + V_r) of V. With
// the N tokens flattened, M_i the max of token i's logits over this shard and lse_i its logsumexp:
//   vocab_ce_local_stats   ([N + W], [N, 2])  M_i (-inf if the shard is empty), then V_r at N + r
//                                  and zeros at the other ranks' slots (a max all-reduce then
//                                  yields the global maxima and every rank's size; sizes >= 0);
//                                  and per token sum_j exp(l_ij - M_i), sum_j l_ij
//   vocab_ce_target_logit  [N]     l_i,target if this shard holds the target, else 0 (a gather;
//                                  device-generic, after the max all-reduce gives the layout)
//   vocab_ce_local_grad    [.., V_r] g_i * (exp(l_ij - lse_i) - (1 - eps) [j == target_i] - eps/V),
//                                  0 for ignored tokens
// local_stats reads the logits once (the max and the sums from one row in cache); the caller
// rescales each sum by exp(M_i - m_i) once the global max m_i is known, so the forward reads the
// logits once and the backward once more. Parallel over tokens (at::vec inner loops), no
// [tokens, vocab] temporaries beyond the logits and their gradient; accumulation in fp32 (fp64
// for fp64 logits).
#include "vocab_cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

#include "../common/checks.h"
#include "../common/dispatch.h"

namespace tp_ext::ops {

void check_logits_target(const at::Tensor& logits, const at::Tensor& target, const char* op) {
  check_logits(logits, op);
  TORCH_CHECK_VALUE(target.defined(), "tp_ext.", op, ": target is an undefined tensor.");
  TORCH_CHECK_VALUE(target.layout() == at::kStrided, "tp_ext.", op,
                    ": target must be a dense (strided) tensor, got layout ", target.layout(),
                    "; call .to_dense() first.");
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong, "tp_ext.", op,
                    ": target must hold int64 class ids, got ", target.scalar_type(),
                    "; pass target.long().");
  const auto lead = logits.sym_sizes().slice(0, logits.dim() - 1);
  TORCH_CHECK_VALUE(target.sym_sizes().equals(lead), "tp_ext.", op, ": target has shape ",
                    target.sym_sizes(), " but logits have shape ", logits.sym_sizes(),
                    "; target must have shape logits.shape[:-1] = ", lead, ".");
  TORCH_CHECK_VALUE(target.device() == logits.device(), "tp_ext.", op, ": target is on ",
                    target.device(), " but logits are on ", logits.device(),
                    "; move both to the same device.");
}

void check_label_smoothing(double label_smoothing, const char* op) {
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0, "tp_ext.", op,
                    ": label_smoothing=", label_smoothing,
                    " is outside [0, 1]; use a value in [0, 1] (0 disables smoothing).");
}

Rows rows_of(const at::Tensor& logits) {
  const int64_t v = logits.size(-1);
  int64_t n = 1;
  for (int64_t d = 0; d + 1 < logits.dim(); ++d) n *= logits.size(d);
  return {logits.contiguous(), n, v};
}

Layout read_layout(const at::Tensor& max_sizes, int64_t tokens, int64_t shard, int64_t group_rank,
                   at::ScalarType logits_dtype, const char* op) {
  const auto want = stats_dtype(logits_dtype);
  TORCH_CHECK_VALUE(
      max_sizes.dim() == 1 && max_sizes.scalar_type() == want && max_sizes.numel() > tokens,
      "tp_ext.", op, ": max_sizes must be the 1-d ", want,
      " tensor [N + group_size] from vocab_ce_local_stats (all-reduced with max), with N = ",
      tokens, " tokens; got shape ", max_sizes.sizes(), " and dtype ", max_sizes.scalar_type(),
      ".");
  const int64_t world = max_sizes.numel() - tokens;
  TORCH_CHECK_VALUE(group_rank >= 0 && group_rank < world, "tp_ext.", op,
                    ": group_rank=", group_rank, " is outside [0, ", world, ") (max_sizes holds ",
                    world, " rank sizes).");
  auto sizes = max_sizes.narrow(0, tokens, world).to(at::kCPU, at::kDouble).contiguous();
  const double* s = sizes.const_data_ptr<double>();
  Layout out{0, 0};
  for (int64_t r = 0; r < world; ++r) {
    const auto size = static_cast<int64_t>(s[r]);
    TORCH_CHECK_VALUE(s[r] >= 0 && static_cast<double>(size) == s[r], "tp_ext.", op,
                      ": max_sizes[N + ", r, "] = ", s[r],
                      " is not a vocabulary size; pass vocab_ce_local_stats's first output after a "
                      "max all-reduce.");
    if (r < group_rank) out.vocab_start += size;
    out.vocab += size;
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(s[group_rank]) == shard, "tp_ext.", op, ": logits hold ",
                    shard, " vocabulary entries but max_sizes says rank ", group_rank, " holds ",
                    s[group_rank],
                    "; every rank must pass its own logits shard and its group_rank.");
  return out;
}

// Every rank checks the same (replicated) targets against the same V, so a bad id makes all
// ranks raise together, before the second all-reduce, instead of one rank hanging.
void check_targets(const at::Tensor& target_in, int64_t ignore_index, int64_t vocab) {
  at::Tensor target = target_in;
  if (!target.is_cpu()) {
    // Device targets: one reduction on the device, copy only the bad ones for the message.
    const auto bad = (target != ignore_index) & ((target < 0) | (target >= vocab));
    if (!bad.any().item<bool>()) return;
    target = target.flatten().cpu().contiguous();
  }
  const int64_t* t = target.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < target.numel(); ++i) {
    TORCH_CHECK_VALUE(
        t[i] == ignore_index || (t[i] >= 0 && t[i] < vocab),
        "tp_ext.vocab_parallel_cross_entropy: target id ", t[i], " (at flat position ", i,
        ") is outside the vocabulary [0, ", vocab,
        ") (V = the sum of every rank's logits shard size) and is not ignore_index=", ignore_index,
        "; targets must be class ids in [0, ", vocab, ") or ignore_index.");
  }
}

LocalStatsArgs prepare_local_stats(const at::Tensor& logits, int64_t group_size,
                                   int64_t group_rank) {
  const char* op = "vocab_ce_local_stats";
  TORCH_CHECK_VALUE(group_size >= 1 && group_rank >= 0 && group_rank < group_size, "tp_ext.", op,
                    ": group_rank=", group_rank, " must be in [0, group_size=", group_size, ").");
  check_logits(logits, op);
  auto rows = rows_of(logits);
  // Sizes travel as floats: exact up to 2^24 in fp32.
  TORCH_CHECK_VALUE(rows.v < (int64_t{1} << 24), "tp_ext.", op, ": a vocabulary shard of ", rows.v,
                    " entries is too large (at most 2^24 - 1 per rank).");
  const auto options = logits.options().dtype(stats_dtype(logits.scalar_type()));
  auto max_sizes = at::zeros({rows.n + group_size}, options);
  // This rank's size slot, written once here so the kernels only fill the N maxima.
  max_sizes.narrow(0, rows.n + group_rank, 1).fill_(static_cast<double>(rows.v));
  auto sums = at::empty({rows.n, 2}, options);
  return {std::move(rows), std::move(max_sizes), std::move(sums)};
}

GradArgs prepare_grad(const at::Tensor& grad_loss, const at::Tensor& logits,
                      const at::Tensor& target, const at::Tensor& max_sizes_in,
                      const at::Tensor& lse_in, double label_smoothing, int64_t group_rank) {
  const char* op = "vocab_ce_local_grad";
  check_logits_target(logits, target, op);
  check_label_smoothing(label_smoothing, op);
  auto rows = rows_of(logits);
  const auto max_sizes = max_sizes_in.contiguous();
  const auto layout = read_layout(max_sizes, rows.n, rows.v, group_rank, logits.scalar_type(), op);
  const auto acc_dtype = stats_dtype(logits.scalar_type());
  TORCH_CHECK_VALUE(grad_loss.numel() == rows.n && lse_in.numel() == rows.n, "tp_ext.", op,
                    ": grad_loss and lse must hold one value per token (", rows.n, "), got shapes ",
                    grad_loss.sizes(), " and ", lse_in.sizes(), ".");
  TORCH_CHECK_VALUE(
      at::isFloatingType(grad_loss.scalar_type()) && lse_in.scalar_type() == acc_dtype, "tp_ext.",
      op, ": grad_loss must be floating point and lse ", acc_dtype, ", got ",
      grad_loss.scalar_type(), " and ", lse_in.scalar_type(), ".");
  TORCH_CHECK_VALUE(grad_loss.device() == logits.device() && lse_in.device() == logits.device(),
                    "tp_ext.", op, ": grad_loss (", grad_loss.device(), ") and lse (",
                    lse_in.device(), ") must be on the logits' device (", logits.device(), ").");
  // Token-sized: a gradient expanded from a reduction (stride 0) becomes a plain vector here.
  auto g = grad_loss.reshape({rows.n}).to(acc_dtype).contiguous();
  auto lse = lse_in.reshape({rows.n}).contiguous();
  auto t = target.contiguous();
  auto out = at::empty(logits.sizes(), logits.options());  // contiguous
  return {std::move(rows), layout, std::move(t), std::move(g), std::move(lse), std::move(out)};
}

namespace {

// Tokens per parallel chunk: enough that a chunk covers ~32k logits.
int64_t grain(int64_t vocab_local) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(vocab_local, 1));
}

// A row as acc_t: the logits themselves when they already are acc_t, else widened into `buf`.
template <typename scalar_t, typename acc_t>
const acc_t* widen(const scalar_t* row, int64_t v, std::vector<acc_t>& buf) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return row;
  } else {
    at::vec::convert(row, buf.data(), v);
    return buf.data();
  }
}

// Where a gradient row is computed: the output itself for acc_t outputs, else `buf`.
template <typename scalar_t, typename acc_t>
acc_t* out_row(scalar_t* grow, std::vector<acc_t>& buf) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return grow;
  } else {
    return buf.data();
  }
}

std::tuple<at::Tensor, at::Tensor> local_stats_cpu(const at::Tensor& logits, int64_t group_size,
                                                   int64_t group_rank) {
  auto a = prepare_local_stats(logits, group_size, group_rank);
  TP_EXT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "vocab_ce_local_stats", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using Vec = at::vec::Vectorized<acc_t>;
    const scalar_t* l = a.rows.logits.const_data_ptr<scalar_t>();
    acc_t* mx = a.max_sizes.data_ptr<acc_t>();
    acc_t* o = a.sums.data_ptr<acc_t>();
    const int64_t v = a.rows.v;
    at::parallel_for(0, a.rows.n, grain(v), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> buf(std::is_same_v<scalar_t, acc_t> ? 0 : v);
      for (int64_t i = begin; i < end; ++i) {
        if (v == 0) {  // an empty shard: -inf, the identity of the max all-reduce; no terms
          mx[i] = -std::numeric_limits<acc_t>::infinity();
          o[2 * i] = o[2 * i + 1] = acc_t(0);
          continue;
        }
        // The row, widened once, stays in cache for the second sweep.
        const acc_t* row = widen<scalar_t, acc_t>(l + i * v, v, buf);
        const acc_t m = at::vec::reduce_all<acc_t>(
            [](const Vec& x, const Vec& y) { return at::vec::maximum(x, y); }, row, v);
        const Vec vm(m);
        Vec vexp(acc_t(0)), vsum(acc_t(0));
        int64_t j = 0;
        for (; j + Vec::size() <= v; j += Vec::size()) {
          const Vec x = Vec::loadu(row + j);
          vexp = vexp + (x - vm).exp();
          vsum = vsum + x;
        }
        acc_t sum_exp = at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), vexp);
        acc_t sum_logits = at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), vsum);
        for (; j < v; ++j) {
          sum_exp += std::exp(row[j] - m);
          sum_logits += row[j];
        }
        mx[i] = m;
        o[2 * i] = sum_exp;
        o[2 * i + 1] = sum_logits;
      }
    });
  });
  return {a.max_sizes, a.sums};
}

// Device-generic (ATen ops): the target's logit where this shard holds it, else 0. Checks the
// targets against V from the all-reduced max_sizes first, so every rank raises on a bad id.
at::Tensor target_logit(const at::Tensor& logits, const at::Tensor& target,
                        const at::Tensor& max_sizes_in, int64_t ignore_index, int64_t group_rank) {
  const char* op = "vocab_ce_target_logit";
  check_logits_target(logits, target, op);
  const int64_t v = logits.size(-1), n = target.numel();
  const auto max_sizes = max_sizes_in.contiguous();
  TORCH_CHECK_VALUE(max_sizes.device() == logits.device(), "tp_ext.", op, ": max_sizes is on ",
                    max_sizes.device(), " but logits are on ", logits.device(), ".");
  const auto layout = read_layout(max_sizes, n, v, group_rank, logits.scalar_type(), op);
  const auto t = target.reshape({n});
  check_targets(t, ignore_index, layout.vocab);
  const auto acc = stats_dtype(logits.scalar_type());
  if (v == 0) return at::zeros({n}, max_sizes.options());
  const auto local = t - layout.vocab_start;
  const auto mine = (t != ignore_index) & (local >= 0) & (local < v);
  const auto picked =
      logits.reshape({n, v}).gather(1, local.clamp(0, v - 1).unsqueeze(1)).squeeze(1).to(acc);
  return picked.masked_fill(mine.logical_not(), 0);
}

at::Tensor local_grad_cpu(const at::Tensor& grad_loss, const at::Tensor& logits,
                          const at::Tensor& target_in, const at::Tensor& max_sizes_in,
                          const at::Tensor& lse_in, int64_t ignore_index, double label_smoothing,
                          int64_t group_rank) {
  auto a =
      prepare_grad(grad_loss, logits, target_in, max_sizes_in, lse_in, label_smoothing, group_rank);
  TP_EXT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "vocab_ce_local_grad", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using Vec = at::vec::Vectorized<acc_t>;
    const scalar_t* l = a.rows.logits.const_data_ptr<scalar_t>();
    const int64_t* t = a.target.const_data_ptr<int64_t>();
    const acc_t* gp = a.g.const_data_ptr<acc_t>();
    const acc_t* lp = a.lse.const_data_ptr<acc_t>();
    scalar_t* o = a.out.data_ptr<scalar_t>();
    const int64_t v = a.rows.v, vocab_start = a.layout.vocab_start;
    const acc_t eps = static_cast<acc_t>(label_smoothing);
    const acc_t smooth = a.layout.vocab > 0 ? eps / static_cast<acc_t>(a.layout.vocab) : acc_t(0);
    at::parallel_for(0, a.rows.n, grain(v), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> buf(std::is_same_v<scalar_t, acc_t> ? 0 : v);
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* grow = o + i * v;
        if (t[i] == ignore_index) {
          std::fill(grow, grow + v, scalar_t(0));
          continue;
        }
        const acc_t* row = widen<scalar_t, acc_t>(l + i * v, v, buf);
        const acc_t gi = gp[i], lse_i = lp[i];
        const int64_t local = t[i] - vocab_start;
        const acc_t x_target = (local >= 0 && local < v) ? row[local] : acc_t(0);
        // fp32 results go straight to the output; reduced precision goes through `buf` (the
        // widened row is no longer needed once x_target is read) and is narrowed once.
        acc_t* dst = out_row<scalar_t, acc_t>(grow, buf);
        const Vec vg(gi), vl(lse_i), vs(smooth);
        int64_t j = 0;
        for (; j + Vec::size() <= v; j += Vec::size())
          (vg * ((Vec::loadu(row + j) - vl).exp() - vs)).store(dst + j);
        for (; j < v; ++j) dst[j] = gi * (std::exp(row[j] - lse_i) - smooth);
        if (local >= 0 && local < v)  // the target's entry also loses (1 - eps)
          dst[local] = gi * (std::exp(x_target - lse_i) - smooth - (acc_t(1) - eps));
        if (!std::is_same_v<scalar_t, acc_t>) at::vec::convert(dst, grow, v);
      }
    });
  });
  return a.out;
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("vocab_ce_local_stats", &tp_ext::ops::local_stats_cpu);
  m.impl("vocab_ce_target_logit", &tp_ext::ops::target_logit);
  m.impl("vocab_ce_local_grad", &tp_ext::ops::local_grad_cpu);
}

// A gather and a few elementwise ops: the same code serves CUDA tensors.
TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) { m.impl("vocab_ce_target_logit", &tp_ext::ops::target_logit); }

// The local pieces have no derivative of their own: vocab_parallel_cross_entropy's autograd
// covers them. Asking for one (e.g. double backward) raises "not implemented" at backward time.
TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  for (const char* name : {"vocab_ce_local_stats", "vocab_ce_target_logit", "vocab_ce_local_grad"})
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
}
