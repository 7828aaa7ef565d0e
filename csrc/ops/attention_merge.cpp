// Merging two partial attention results over disjoint key blocks (ring attention, context
// parallelism): the shared argument setup, the CPU kernels and the C++ autograd (CUDA kernels:
// attention_merge_cuda.cu).
//
// Each partial result is softmax(q K_b^T) V_b over its keys, out_b [..., S, D], with its
// log-sum-exp lse_b [..., S] (what flash attention returns). Per row, with
// lse = log(e^lse_a + e^lse_b), w_a = e^(lse_a - lse), w_b = e^(lse_b - lse):
//   attention_merge: out = w_a out_a + w_b out_b, and lse   (the attention over both blocks)
//   attention_merge_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse):
//     grad_out_x = w_x grad_out,  grad_lse_x = w_x (sum_d grad_out (out_x - out) + grad_lse)
// A block with no keys for a row has lse -inf (weight 0); two such give lse -inf and out 0. Math
// in the lse's dtype (fp32, or double), outputs rounded to out_a's dtype once.
#include "attention_merge.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "../common/dispatch.h"

namespace tp_ext::ops {

namespace {

void check_pair(const at::Tensor& out, const at::Tensor& lse, const char* name, const char* op) {
  TORCH_CHECK_VALUE(out.defined() && out.layout() == at::kStrided && out.dim() >= 1, "tp_ext.", op,
                    ": out_", name, " must be a dense tensor [..., S, D].");
  TORCH_CHECK_VALUE(at::isFloatingType(out.scalar_type()), "tp_ext.", op, ": out_", name,
                    " must be floating point, got ", out.scalar_type(), ".");
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat || lse.scalar_type() == at::kDouble, "tp_ext.",
                    op, ": lse_", name, " must be float32 or float64 (flash attention's ",
                    "log-sum-exp), got ", lse.scalar_type(), ".");
  const auto rows = out.sizes().slice(0, out.dim() - 1);
  TORCH_CHECK_VALUE(lse.sizes().equals(rows), "tp_ext.", op, ": lse_", name, " has shape ",
                    lse.sizes(), " but out_", name, " has shape ", out.sizes(), "; lse_", name,
                    " must have shape ", rows, " (out's without its last dimension).");
}

}  // namespace

MergeArgs attention_merge_args(const at::Tensor& out_a, const at::Tensor& lse_a,
                               const at::Tensor& out_b, const at::Tensor& lse_b, const char* op) {
  check_pair(out_a, lse_a, "a", op);
  check_pair(out_b, lse_b, "b", op);
  TORCH_CHECK_VALUE(
      out_a.sizes().equals(out_b.sizes()) && out_a.scalar_type() == out_b.scalar_type() &&
          lse_a.scalar_type() == lse_b.scalar_type(),
      "tp_ext.", op, ": out_a ", out_a.sizes(), " ", out_a.scalar_type(), " and out_b ",
      out_b.sizes(), " ", out_b.scalar_type(), " (and their lse dtypes) must match.");
  TORCH_CHECK_VALUE(out_a.device() == out_b.device() && out_a.device() == lse_a.device() &&
                        out_a.device() == lse_b.device(),
                    "tp_ext.", op, ": all inputs must be on one device.");
  const int64_t d = out_a.size(-1);
  const int64_t n = lse_a.numel();
  MergeArgs a;
  a.shape = out_a.sizes().vec();
  a.out_a = out_a.contiguous().view({n, d});
  a.out_b = out_b.contiguous().view({n, d});
  a.lse_a = lse_a.contiguous().view({n});
  a.lse_b = lse_b.contiguous().view({n});
  a.out = at::empty({n, d}, a.out_a.options());
  a.lse = at::empty({n}, a.lse_a.options());
  return a;
}

MergeBackwardArgs attention_merge_backward_args(const at::Tensor& grad_out,
                                                const at::Tensor& grad_lse, const at::Tensor& out_a,
                                                const at::Tensor& lse_a, const at::Tensor& out_b,
                                                const at::Tensor& lse_b, const at::Tensor& out,
                                                const at::Tensor& lse) {
  const char* op = "attention_merge_backward";
  MergeBackwardArgs b;
  b.merge = attention_merge_args(out_a, lse_a, out_b, lse_b, op);
  auto& m = b.merge;
  const int64_t n = m.lse_a.numel(), d = out_a.size(-1);
  TORCH_CHECK_VALUE(out.sizes().equals(out_a.sizes()) && lse.sizes().equals(lse_a.sizes()) &&
                        grad_out.sizes().equals(out_a.sizes()) &&
                        grad_lse.sizes().equals(lse_a.sizes()),
                    "tp_ext.", op, ": grad_out and out must have out_a's shape ", out_a.sizes(),
                    ", grad_lse and lse lse_a's ", lse_a.sizes(), ".");
  m.out = out.to(m.out_a.scalar_type()).contiguous().view({n, d});
  m.lse = lse.to(m.lse_a.scalar_type()).contiguous().view({n});
  b.grad_out = grad_out.to(m.out_a.scalar_type()).contiguous().view({n, d});
  b.grad_lse = grad_lse.to(m.lse_a.scalar_type()).contiguous().view({n});
  b.grad_out_a = at::empty({n, d}, m.out_a.options());
  b.grad_out_b = at::empty({n, d}, m.out_a.options());
  b.grad_lse_a = at::empty({n}, m.lse_a.options());
  b.grad_lse_b = at::empty({n}, m.lse_a.options());
  return b;
}

std::tuple<at::Tensor, at::Tensor> attention_merge_results(const MergeArgs& a) {
  const auto rows = at::IntArrayRef(a.shape).slice(0, a.shape.size() - 1);
  return {a.out.view(a.shape), a.lse.view(rows)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_merge_backward_results(
    const MergeBackwardArgs& b) {
  const auto& shape = b.merge.shape;
  const auto rows = at::IntArrayRef(shape).slice(0, shape.size() - 1);
  return {b.grad_out_a.view(shape), b.grad_lse_a.view(rows), b.grad_out_b.view(shape),
          b.grad_lse_b.view(rows)};
}

namespace {

// lse = log(e^a + e^b) and the two weights; both -inf (no keys at all) gives weights 0.
template <typename A>
inline void merge_weights(A a, A b, A& lse, A& wa, A& wb) {
  const A hi = std::max(a, b);
  if (hi == -std::numeric_limits<A>::infinity()) {
    lse = hi, wa = 0, wb = 0;
    return;
  }
  lse = hi + std::log1p(std::exp(std::min(a, b) - hi));
  wa = std::exp(a - lse), wb = std::exp(b - lse);
}

std::tuple<at::Tensor, at::Tensor> attention_merge_cpu(const at::Tensor& out_a,
                                                       const at::Tensor& lse_a,
                                                       const at::Tensor& out_b,
                                                       const at::Tensor& lse_b) {
  auto a = attention_merge_args(out_a, lse_a, out_b, lse_b, "attention_merge");
  const int64_t n = a.lse.numel(), d = a.out.size(1);
  AT_DISPATCH_FLOATING_TYPES(a.lse.scalar_type(), "attention_merge", [&] {
    using A = scalar_t;
    const A* la = a.lse_a.data_ptr<A>();
    const A* lb = a.lse_b.data_ptr<A>();
    A* l = a.lse.data_ptr<A>();
    TP_EXT_DISPATCH_FLOATING_TYPES(a.out.scalar_type(), "attention_merge", [&] {
      const scalar_t* oa = a.out_a.data_ptr<scalar_t>();
      const scalar_t* ob = a.out_b.data_ptr<scalar_t>();
      scalar_t* o = a.out.data_ptr<scalar_t>();
      at::parallel_for(0, n, std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1)),
                       [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          A wa, wb;
          merge_weights<A>(la[r], lb[r], l[r], wa, wb);
          for (int64_t k = r * d; k < (r + 1) * d; ++k)
            o[k] = static_cast<scalar_t>(wa * static_cast<A>(oa[k]) + wb * static_cast<A>(ob[k]));
        }
      });
    });
  });
  return attention_merge_results(a);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_merge_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& out_a,
    const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b,
    const at::Tensor& out, const at::Tensor& lse) {
  auto b = attention_merge_backward_args(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse);
  const auto& m = b.merge;
  const int64_t n = m.lse.numel(), d = m.out.size(1);
  AT_DISPATCH_FLOATING_TYPES(m.lse.scalar_type(), "attention_merge_backward", [&] {
    using A = scalar_t;
    const A* la = m.lse_a.data_ptr<A>();
    const A* lb = m.lse_b.data_ptr<A>();
    const A* gl = b.grad_lse.data_ptr<A>();
    A* gla = b.grad_lse_a.data_ptr<A>();
    A* glb = b.grad_lse_b.data_ptr<A>();
    TP_EXT_DISPATCH_FLOATING_TYPES(m.out.scalar_type(), "attention_merge_backward", [&] {
      const scalar_t* oa = m.out_a.data_ptr<scalar_t>();
      const scalar_t* ob = m.out_b.data_ptr<scalar_t>();
      const scalar_t* o = m.out.data_ptr<scalar_t>();
      const scalar_t* go = b.grad_out.data_ptr<scalar_t>();
      scalar_t* goa = b.grad_out_a.data_ptr<scalar_t>();
      scalar_t* gob = b.grad_out_b.data_ptr<scalar_t>();
      at::parallel_for(0, n, std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1)),
                       [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          A l, wa, wb;
          merge_weights<A>(la[r], lb[r], l, wa, wb);
          A sa = 0, sb = 0;
          for (int64_t k = r * d; k < (r + 1) * d; ++k) {
            const A g = static_cast<A>(go[k]), mo = static_cast<A>(o[k]);
            sa += g * (static_cast<A>(oa[k]) - mo);
            sb += g * (static_cast<A>(ob[k]) - mo);
            goa[k] = static_cast<scalar_t>(wa * g);
            gob[k] = static_cast<scalar_t>(wb * g);
          }
          gla[r] = wa * (sa + gl[r]);
          glb[r] = wb * (sb + gl[r]);
        }
      });
    });
  });
  return attention_merge_backward_results(b);
}

using MergeSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&);
using MergeBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&);

class AttentionMerge : public torch::autograd::Function<AttentionMerge> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& out_a, const at::Tensor& lse_a,
                                                const at::Tensor& out_b, const at::Tensor& lse_b) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = op_handle("attention_merge").typed<MergeSig>();
    auto [out, lse] = op.call(out_a, lse_a, out_b, lse_b);
    ctx->save_for_backward({out_a, lse_a, out_b, lse_b, out, lse});
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    static const auto op = op_handle("attention_merge_backward").typed<MergeBackwardSig>();
    auto [goa, gla, gob, glb] = op.call(grads[0], grads[1], s[0], s[1], s[2], s[3], s[4], s[5]);
    return {goa, gla, gob, glb};
  }
};

std::tuple<at::Tensor, at::Tensor> attention_merge_autograd(const at::Tensor& out_a,
                                                            const at::Tensor& lse_a,
                                                            const at::Tensor& out_b,
                                                            const at::Tensor& lse_b) {
  auto out = AttentionMerge::apply(out_a, lse_a, out_b, lse_b);
  return {out[0], out[1]};
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("attention_merge", &tp_ext::ops::attention_merge_cpu);
  m.impl("attention_merge_backward", &tp_ext::ops::attention_merge_backward_cpu);
}

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("attention_merge", &tp_ext::ops::attention_merge_autograd);
  m.impl("attention_merge_backward", torch::autograd::autogradNotImplementedFallback());
}
