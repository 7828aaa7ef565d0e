// CPU kernels of the local (non-communicating) pieces of tp_ext.vocab_parallel_cross_entropy.
//
// Rank r holds logits[..., V_r]: vocabulary entries [vocab_start, vocab_start + V_r) of V. With
// the N tokens flattened, m_i the global max of token i's logits and lse_i its logsumexp:
//   vocab_ce_local_max    [N + W]  max_j l_ij over this shard (-inf if empty); V_r at N + r,
//                                  zeros at the other ranks' slots (a max all-reduce then
//                                  yields every rank's size; sizes are >= 0)
//   vocab_ce_local_stats  [N, 3]   sum_j exp(l_ij - m_i), l_i,target (0 unless this shard holds
//                                  it), sum_j l_ij (for label smoothing over the full vocabulary)
//   vocab_ce_local_grad   [.., V_r] g_i * (exp(l_ij - lse_i) - (1 - eps) [j == target_i] - eps/V),
//                                  0 for ignored tokens
// Each is one pass over the logits, parallel over tokens, with no [tokens, vocab] temporaries
// beyond the logits and their gradient. Accumulation is in fp32 (fp64 for fp64 logits).
#include "vocab_cross_entropy.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

namespace tp_ext::loss {


void check_logits(const at::Tensor& logits, const char* op) {
  TORCH_CHECK_VALUE(logits.defined(), "tp_ext.", op, ": logits is an undefined tensor.");
  TORCH_CHECK_VALUE(logits.layout() == at::kStrided, "tp_ext.", op,
                    ": logits must be a dense (strided) tensor, got layout ", logits.layout(),
                    "; call .to_dense() first.");
  const auto dt = logits.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
                    "tp_ext.", op, ": logits must be floating point (float32, float64, bfloat16 or "
                    "float16), got ", dt, ".");
  TORCH_CHECK_VALUE(logits.dim() >= 1, "tp_ext.", op,
                    ": logits must have a vocabulary dimension (shape [..., V_local]), got a 0-d "
                    "tensor.");
}

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
                    target.sym_sizes(), " but logits have shape ",
                    logits.sym_sizes(), "; target must have shape logits.shape[:-1] = ",
                    lead, ".");
  TORCH_CHECK_VALUE(target.device() == logits.device(), "tp_ext.", op, ": target is on ",
                    target.device(), " but logits are on ", logits.device(),
                    "; move both to the same device.");
}

void check_label_smoothing(double label_smoothing, const char* op) {
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0, "tp_ext.", op,
                    ": label_smoothing=", label_smoothing, " is outside [0, 1]; use a value in "
                    "[0, 1] (0 disables smoothing).");
}

namespace {

// Tokens per parallel chunk: enough that a chunk covers ~32k logits.
int64_t grain(int64_t vocab_local) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(vocab_local, 1));
}

// Logits as a contiguous [N, V_r] matrix (a copy only when the input is not contiguous).
struct Rows {
  at::Tensor logits;
  int64_t n;
  int64_t v;
};

Rows rows_of(const at::Tensor& logits) {
  const int64_t v = logits.size(-1);
  int64_t n = 1;
  for (int64_t d = 0; d + 1 < logits.dim(); ++d) n *= logits.size(d);
  return {logits.contiguous(), n, v};
}

// Where this rank's shard sits in the vocabulary, read from the max all-reduced `max_sizes`.
struct Layout {
  int64_t vocab_start;
  int64_t vocab;
};

Layout read_layout(const at::Tensor& max_sizes, const Rows& rows, int64_t group_rank,
                   at::ScalarType logits_dtype, const char* op) {
  const auto want = stats_dtype(logits_dtype);
  TORCH_CHECK_VALUE(max_sizes.dim() == 1 && max_sizes.scalar_type() == want &&
                        max_sizes.numel() > rows.n,
                    "tp_ext.", op, ": max_sizes must be the 1-d ", want,
                    " tensor [N + group_size] from vocab_ce_local_max (all-reduced with max), with "
                    "N = ", rows.n, " tokens; got shape ", max_sizes.sizes(), " and dtype ",
                    max_sizes.scalar_type(), ".");
  const int64_t world = max_sizes.numel() - rows.n;
  TORCH_CHECK_VALUE(group_rank >= 0 && group_rank < world, "tp_ext.", op, ": group_rank=",
                    group_rank, " is outside [0, ", world, ") (max_sizes holds ", world,
                    " rank sizes).");
  auto sizes = max_sizes.narrow(0, rows.n, world).to(at::kDouble).contiguous();
  const double* s = sizes.const_data_ptr<double>();
  Layout out{0, 0};
  for (int64_t r = 0; r < world; ++r) {
    const auto size = static_cast<int64_t>(s[r]);
    TORCH_CHECK_VALUE(s[r] >= 0 && static_cast<double>(size) == s[r], "tp_ext.", op,
                      ": max_sizes[N + ", r, "] = ", s[r],
                      " is not a vocabulary size; pass vocab_ce_local_max's output after a max "
                      "all-reduce.");
    if (r < group_rank) out.vocab_start += size;
    out.vocab += size;
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(s[group_rank]) == rows.v, "tp_ext.", op,
                    ": logits hold ", rows.v, " vocabulary entries but max_sizes says rank ",
                    group_rank, " holds ", s[group_rank],
                    "; every rank must pass its own logits shard and its group_rank.");
  return out;
}

// Every rank checks the same (replicated) targets against the same V, so a bad id makes all
// ranks raise together, before the second all-reduce, instead of one rank hanging.
void check_targets(const at::Tensor& target, int64_t ignore_index, int64_t vocab) {
  const int64_t* t = target.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < target.numel(); ++i) {
    TORCH_CHECK_VALUE(t[i] == ignore_index || (t[i] >= 0 && t[i] < vocab),
                      "tp_ext.vocab_parallel_cross_entropy: target id ", t[i],
                      " (at flat position ", i, ") is outside the vocabulary [0, ", vocab,
                      ") (V = the sum of every rank's logits shard size) and is not ignore_index=",
                      ignore_index, "; targets must be class ids in [0, ", vocab,
                      ") or ignore_index.");
  }
}

at::Tensor local_max_cpu(const at::Tensor& logits, int64_t group_size, int64_t group_rank) {
  const char* op = "vocab_ce_local_max";
  TORCH_CHECK_VALUE(group_size >= 1 && group_rank >= 0 && group_rank < group_size, "tp_ext.", op,
                    ": group_rank=", group_rank, " must be in [0, group_size=", group_size, ").");
  check_logits(logits, op);
  const auto rows = rows_of(logits);
  // Sizes travel as floats: exact up to 2^24 in fp32.
  TORCH_CHECK_VALUE(rows.v < (int64_t{1} << 24), "tp_ext.", op, ": a vocabulary shard of ",
                    rows.v, " entries is too large (at most 2^24 - 1 per rank).");
  auto out = at::zeros({rows.n + group_size}, logits.options().dtype(stats_dtype(logits.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "vocab_ce_local_max", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* l = rows.logits.const_data_ptr<scalar_t>();
    acc_t* o = out.data_ptr<acc_t>();
    const int64_t v = rows.v;
    at::parallel_for(0, rows.n, grain(v), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        acc_t best = -std::numeric_limits<acc_t>::infinity();
        const scalar_t* row = l + i * v;
        for (int64_t j = 0; j < v; ++j) {
          const acc_t x = static_cast<acc_t>(row[j]);
          best = x > best ? x : best;
        }
        o[i] = best;
      }
    });
    o[rows.n + group_rank] = static_cast<acc_t>(v);
  });
  return out;
}

at::Tensor local_stats_cpu(const at::Tensor& logits, const at::Tensor& target_in,
                           const at::Tensor& max_sizes_in, int64_t ignore_index,
                           int64_t group_rank) {
  const char* op = "vocab_ce_local_stats";
  check_logits_target(logits, target_in, op);
  const auto rows = rows_of(logits);
  const auto max_sizes = max_sizes_in.contiguous();
  const auto layout = read_layout(max_sizes, rows, group_rank, logits.scalar_type(), op);
  const auto target = target_in.contiguous();
  check_targets(target, ignore_index, layout.vocab);
  auto out = at::empty({rows.n, 3}, max_sizes.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "vocab_ce_local_stats", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* l = rows.logits.const_data_ptr<scalar_t>();
    const int64_t* t = target.const_data_ptr<int64_t>();
    const acc_t* m = max_sizes.const_data_ptr<acc_t>();
    acc_t* o = out.data_ptr<acc_t>();
    const int64_t v = rows.v;
    at::parallel_for(0, rows.n, grain(v), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* row = l + i * v;
        acc_t sum_exp = 0, sum_logits = 0;
        for (int64_t j = 0; j < v; ++j) {
          const acc_t x = static_cast<acc_t>(row[j]);
          sum_exp += std::exp(x - m[i]);
          sum_logits += x;
        }
        const int64_t local = t[i] - layout.vocab_start;  // target's index in this shard
        const bool mine = t[i] != ignore_index && local >= 0 && local < v;
        o[3 * i] = sum_exp;
        o[3 * i + 1] = mine ? static_cast<acc_t>(row[local]) : acc_t(0);
        o[3 * i + 2] = sum_logits;
      }
    });
  });
  return out;
}

at::Tensor local_grad_cpu(const at::Tensor& grad_loss, const at::Tensor& logits,
                          const at::Tensor& target_in, const at::Tensor& max_sizes_in,
                          const at::Tensor& lse_in, int64_t ignore_index, double label_smoothing,
                          int64_t group_rank) {
  const char* op = "vocab_ce_local_grad";
  check_logits_target(logits, target_in, op);
  check_label_smoothing(label_smoothing, op);
  const auto rows = rows_of(logits);
  const auto max_sizes = max_sizes_in.contiguous();
  const auto layout = read_layout(max_sizes, rows, group_rank, logits.scalar_type(), op);
  const auto acc_dtype = stats_dtype(logits.scalar_type());
  TORCH_CHECK_VALUE(grad_loss.numel() == rows.n && lse_in.numel() == rows.n, "tp_ext.", op,
                    ": grad_loss and lse must hold one value per token (", rows.n,
                    "), got shapes ", grad_loss.sizes(), " and ", lse_in.sizes(), ".");
  TORCH_CHECK_VALUE(at::isFloatingType(grad_loss.scalar_type()) && lse_in.scalar_type() == acc_dtype,
                    "tp_ext.", op, ": grad_loss must be floating point and lse ", acc_dtype,
                    ", got ", grad_loss.scalar_type(), " and ", lse_in.scalar_type(), ".");
  // Token-sized: a gradient expanded from a reduction (stride 0) becomes a plain vector here.
  const auto g = grad_loss.reshape({rows.n}).to(acc_dtype).contiguous();
  const auto lse = lse_in.reshape({rows.n}).contiguous();
  const auto target = target_in.contiguous();
  auto out = at::empty(logits.sizes(), logits.options());  // contiguous
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "vocab_ce_local_grad", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* l = rows.logits.const_data_ptr<scalar_t>();
    const int64_t* t = target.const_data_ptr<int64_t>();
    const acc_t* gp = g.const_data_ptr<acc_t>();
    const acc_t* lp = lse.const_data_ptr<acc_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t v = rows.v;
    const acc_t eps = static_cast<acc_t>(label_smoothing);
    const acc_t smooth = layout.vocab > 0 ? eps / static_cast<acc_t>(layout.vocab) : acc_t(0);
    at::parallel_for(0, rows.n, grain(v), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* row = l + i * v;
        scalar_t* grow = o + i * v;
        if (t[i] == ignore_index) {
          std::fill(grow, grow + v, scalar_t(0));
          continue;
        }
        const acc_t gi = gp[i], lse_i = lp[i];
        for (int64_t j = 0; j < v; ++j)
          grow[j] = static_cast<scalar_t>(gi * (std::exp(static_cast<acc_t>(row[j]) - lse_i) - smooth));
        const int64_t local = t[i] - layout.vocab_start;
        if (local >= 0 && local < v) {  // the target's entry also loses (1 - eps)
          const acc_t p = std::exp(static_cast<acc_t>(row[local]) - lse_i);
          grow[local] = static_cast<scalar_t>(gi * (p - smooth - (acc_t(1) - eps)));
        }
      }
    });
  });
  return out;
}

// No CUDA kernels yet (CPU only); a clear error instead of the dispatcher's "no kernel" message.
void cuda_not_implemented(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "tp_ext.", op.schema().name().substr(8),
                              " has no CUDA kernel yet (CPU only); move logits and target to the "
                              "CPU, or gather the logits and use torch.nn.functional.cross_entropy.");
}

}  // namespace

void register_cuda_not_implemented(torch::Library& m, const char* name) {
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<&cuda_not_implemented>());
}

}  // namespace tp_ext::loss

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("vocab_ce_local_max", &tp_ext::loss::local_max_cpu);
  m.impl("vocab_ce_local_stats", &tp_ext::loss::local_stats_cpu);
  m.impl("vocab_ce_local_grad", &tp_ext::loss::local_grad_cpu);
}

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  for (const char* name : {"vocab_ce_local_max", "vocab_ce_local_stats", "vocab_ce_local_grad"})
    tp_ext::loss::register_cuda_not_implemented(m, name);
}

// The local pieces have no derivative of their own: vocab_parallel_cross_entropy's autograd
// covers them. Asking for one (e.g. double backward) raises "not implemented" at backward time.
TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  for (const char* name : {"vocab_ce_local_max", "vocab_ce_local_stats", "vocab_ce_local_grad"})
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
}
