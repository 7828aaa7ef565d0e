// linear: y = x W^T + b through tp_ext's GEMMs (common/gemm.h: oneDNN for float32 on CPU, aten's
// kernels elsewhere), with C++ autograd. The local GEMM of layers whose communication is a
// separate op (a row-parallel layer's partial product before reduce_from_tp, sequence-parallel
// layers without the overlapped rings), so their GEMMs are the fused ops' GEMMs.
//
// Device-generic: one kernel registered for CPU and CUDA (the helper dispatches to the device).
// Its backward is the op itself on transposed operands, called through the dispatcher (so it is
// differentiable again: double backward, e.g. a Hessian or a gradient penalty):
//   grad_x = grad W = linear(grad, W^T),  grad_W = grad^T x = linear(grad^T, x^T).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "../common/checks.h"
#include "../common/dispatch.h"
#include "../common/gemm.h"

namespace tp_ext::ops {
namespace {

at::Tensor linear_kernel(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  check_linear(x, weight, bias, "linear");
  return tp_ext::linear(x, weight, bias.has_value() ? *bias : at::Tensor());
}

using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&);

at::Tensor call_linear(const at::Tensor& x, const at::Tensor& weight) {
  static const auto op = op_handle("linear").typed<LinearSig>();
  return op.call(x, weight, std::nullopt);
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    // x only for the weight's gradient, the weight only for x's (as aten's linear saves them): a
    // frozen layer keeps no activation
    ctx->save_for_backward(
        {weight.requires_grad() ? x : at::Tensor(), x.requires_grad() ? weight : at::Tensor()});
    // an absent bias is no input of the node: needs_input_grad(2) would be out of range
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = op_handle("linear").typed<LinearSig>();
    return op.call(x, weight, bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& weight = saved[1];
    const auto g2 = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor grad_x, grad_w, grad_b;
    // Called at the autograd level: with create_graph the op's own autograd records these
    // (double backward); otherwise grad mode is off here and nothing is recorded.
    if (ctx->needs_input_grad(0)) grad_x = call_linear(grads[0], weight.t());
    if (ctx->needs_input_grad(1)) grad_w = call_linear(g2.t(), x.reshape({-1, x.size(-1)}).t());
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) grad_b = g2.sum(0);
    return {grad_x, grad_w, grad_b};
  }
};

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  return LinearFunction::apply(x, weight, bias);
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) { m.impl("linear", &tp_ext::ops::linear_kernel); }
TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) { m.impl("linear", &tp_ext::ops::linear_kernel); }
TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) { m.impl("linear", &tp_ext::ops::linear_autograd); }
