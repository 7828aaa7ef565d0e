// tp_ext.vocab_parallel_cross_entropy: cross-entropy of vocabulary-sharded logits, never
// gathering them. Per token, with m the global max, S = sum_j exp(l_j - m) and L = sum_j l_j over
// the full vocabulary V, t the target logit and eps the label smoothing:
//   lse = m + log S,   loss = lse - (1 - eps) t - eps L / V   (0 where target == ignore_index)
//
// Forward: vocab_ce_local_stats (the only read of the logits: this shard's max M and, relative to
// it, the sum of exponentials and of logits) -> all_reduce(max) -> the sums rescaled by
// exp(M - m) and the target logit picked (vocab_ce_target_logit) -> all_reduce(sum) -> a few
// token-sized elementwise ops. The first all-reduce also carries every rank's shard size (so
// vocab_start and V need neither another collective nor the caller); both are token-sized.
// Backward: vocab_ce_local_grad from the saved logits, target, max_sizes and lse; no communication.
//
// Every step is a registered op called through the dispatcher below autograd, so torch.compile /
// AOTAutograd trace the collectives (ordered effects) and the local kernels into the graph, as the
// Megatron pairs do (comm/megatron_pairs.cpp).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>

#include "../common/dispatch.h"
#include "../common/group.h"
#include "vocab_cross_entropy.h"

namespace tp_ext::ops {
namespace {

constexpr const char* kOp = "vocab_parallel_cross_entropy";

at::Tensor call_all_reduce(const at::Tensor& x, const char* reduce, c10::string_view group_name,
                           int64_t group_size) {
  using Sig = at::Tensor(const at::Tensor&, c10::string_view, c10::string_view, int64_t);
  static const auto op = op_handle("all_reduce").typed<Sig>();
  return op.call(x, reduce, group_name, group_size);
}

std::tuple<at::Tensor, at::Tensor> call_local_stats(const at::Tensor& logits, int64_t group_size,
                                                    int64_t group_rank) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, int64_t);
  static const auto op = op_handle("vocab_ce_local_stats").typed<Sig>();
  return op.call(logits, group_size, group_rank);
}

at::Tensor call_target_logit(const at::Tensor& logits, const at::Tensor& target,
                             const at::Tensor& max_sizes, int64_t ignore_index,
                             int64_t group_rank) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t);
  static const auto op = op_handle("vocab_ce_target_logit").typed<Sig>();
  return op.call(logits, target, max_sizes, ignore_index, group_rank);
}

at::Tensor call_local_grad(const at::Tensor& grad_loss, const at::Tensor& logits,
                           const at::Tensor& target, const at::Tensor& max_sizes,
                           const at::Tensor& lse, int64_t ignore_index, double label_smoothing,
                           int64_t group_rank) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, int64_t, double, int64_t);
  static const auto op = op_handle("vocab_ce_local_grad").typed<Sig>();
  return op.call(grad_loss, logits, target, max_sizes, lse, ignore_index, label_smoothing,
                 group_rank);
}

struct Forward {
  at::Tensor loss;       // target.shape
  at::Tensor max_sizes;  // [N + group_size], saved for backward (it holds the shard layout)
  at::Tensor lse;        // target.shape, saved for backward
};

// Shapes are symbolic while torch.compile traces, hence the *_symint calls.
Forward run_forward(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                    double label_smoothing, c10::string_view group_name, int64_t group_size,
                    int64_t group_rank) {
  at::AutoDispatchBelowADInplaceOrView guard;
  // Every check before the first collective, so bad arguments fail on every rank without a hang.
  check_logits_target(logits, target, kOp);
  check_label_smoothing(label_smoothing, kOp);
  if (!logits.is_meta())  // checks group_size and group_rank against the live group
    resolve_group(group_name, group_size, logits.device(), kOp, group_rank);

  const auto [local_max_sizes, sums] = call_local_stats(logits, group_size, group_rank);
  const auto max_sizes = call_all_reduce(local_max_sizes, "max", group_name, group_size);
  const auto n = target.sym_numel();
  // sum exp(l - m) = exp(M - m) sum exp(l - M); a shard with no finite logit adds nothing
  const auto local_max = local_max_sizes.narrow_symint(0, 0, n);
  const auto scaled = (sums.select(1, 0) * (local_max - max_sizes.narrow_symint(0, 0, n)).exp())
                          .masked_fill(local_max == -std::numeric_limits<double>::infinity(), 0);
  const auto target_logit = call_target_logit(logits, target, max_sizes, ignore_index, group_rank);
  const auto totals = call_all_reduce(at::stack({scaled, target_logit, sums.select(1, 1)}, 1),
                                      "sum", group_name, group_size);

  const auto shape = target.sym_sizes();
  const auto column = [&](int64_t k) { return totals.select(1, k).reshape_symint(shape); };
  const auto m = max_sizes.narrow_symint(0, 0, n).reshape_symint(shape);
  auto lse = m + column(0).log();
  auto loss = lse - column(1) * (1.0 - label_smoothing);
  if (label_smoothing > 0) {  // skipped at 0 so -inf logits (masked vocab) give no 0 * inf = nan
    const auto vocab = max_sizes.narrow_symint(0, n, group_size).sum();
    loss = loss - column(2) * label_smoothing / vocab;
  }
  loss = loss.masked_fill(target == ignore_index, 0);
  return {loss, max_sizes, lse};
}

// Below autograd (inference mode, or a caller that already handles autograd).
at::Tensor forward_kernel(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                          double label_smoothing, c10::string_view group_name, int64_t group_size,
                          int64_t group_rank) {
  return run_forward(logits, target, ignore_index, label_smoothing, group_name, group_size,
                     group_rank)
      .loss;
}

class VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, int64_t ignore_index, double label_smoothing,
                            const std::string& group_name, int64_t group_size, int64_t group_rank) {
    auto f = run_forward(logits, target, ignore_index, label_smoothing, group_name, group_size,
                         group_rank);
    // The logits themselves, not a softmax copy: no extra [tokens, vocab] tensor is kept.
    ctx->save_for_backward({logits, target, f.max_sizes, f.lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["group_rank"] = group_rank;
    return f.loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto grad_logits = call_local_grad(
        grads[0], saved[0], saved[1], saved[2], saved[3], ctx->saved_data["ignore_index"].toInt(),
        ctx->saved_data["label_smoothing"].toDouble(), ctx->saved_data["group_rank"].toInt());
    return {grad_logits,  at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor autograd_kernel(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                           double label_smoothing, c10::string_view group_name, int64_t group_size,
                           int64_t group_rank) {
  return VocabParallelCrossEntropy::apply(logits, target, ignore_index, label_smoothing,
                                          std::string(group_name), group_size, group_rank);
}

}  // namespace
}  // namespace tp_ext::ops

// Device-generic (no .cu): the same kernel serves CPU and CUDA tensors, since every step it calls
// dispatches to that device's kernels (the local pieces) or backend (the all-reduces).
TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("vocab_parallel_cross_entropy", &tp_ext::ops::forward_kernel);
}

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("vocab_parallel_cross_entropy", &tp_ext::ops::forward_kernel);
}

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("vocab_parallel_cross_entropy", &tp_ext::ops::autograd_kernel);
}
