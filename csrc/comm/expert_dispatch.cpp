// all_to_all_single: the uneven all-to-all of expert parallelism (tokens to the ranks of their
// experts and back), as a differentiable op. The same code serves CPU and CUDA tensors (the
// process group's backend does the device work). Its backward is the same op with send and
// receive sizes swapped, called through the dispatcher so compiled backward graphs see the op.
#include <c10/core/SymIntArrayRef.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "../common/dispatch.h"
#include "collectives.h"

namespace tp_ext::comm {
namespace {

constexpr const char* kOp = "all_to_all_single";

at::Tensor all_to_all_single_op(const at::Tensor& x, c10::SymIntArrayRef send_sizes,
                                c10::SymIntArrayRef recv_sizes, c10::string_view group_name,
                                int64_t group_size) {
  auto g = resolve_group(group_name, group_size, x.device(), kOp);
  return all_to_all_single(x, C10_AS_INTARRAYREF_SLOW(send_sizes),
                           C10_AS_INTARRAYREF_SLOW(recv_sizes), g, kOp);
}

using Sig = at::Tensor(const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef,
                       c10::string_view, int64_t);

class AllToAllSingleFn : public torch::autograd::Function<AllToAllSingleFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            c10::SymIntArrayRef send_sizes, c10::SymIntArrayRef recv_sizes,
                            c10::string_view group_name, int64_t group_size) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto handle = op_handle(kOp).typed<Sig>();
    ctx->saved_data["send"] = c10::IValue(send_sizes);
    ctx->saved_data["recv"] = c10::IValue(recv_sizes);
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["group_size"] = group_size;
    auto out = handle.call(x, send_sizes, recv_sizes, group_name, group_size);
    ctx->saved_data["out_like"] = at::empty({0}, out.options());
    ctx->saved_data["out_shape"] = c10::IValue(out.sym_sizes());
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto handle = op_handle(kOp).typed<Sig>();
    // Every rank must take part in the reverse exchange, even one whose gradient is undefined.
    const auto send = ctx->saved_data["send"].toSymIntVector();
    const auto recv = ctx->saved_data["recv"].toSymIntVector();
    const auto group_name = ctx->saved_data["group_name"].toStringRef();
    const auto group_size = ctx->saved_data["group_size"].toInt();
    auto grad = grads[0];
    if (!grad.defined())
      grad = at::zeros_symint(ctx->saved_data["out_shape"].toSymIntVector(),
                              ctx->saved_data["out_like"].toTensor().options());
    return {handle.call(grad, recv, send, group_name, group_size), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor all_to_all_single_autograd(const at::Tensor& x, c10::SymIntArrayRef send_sizes,
                                      c10::SymIntArrayRef recv_sizes, c10::string_view group_name,
                                      int64_t group_size) {
  return AllToAllSingleFn::apply(x, send_sizes, recv_sizes, group_name, group_size);
}

}  // namespace
}  // namespace tp_ext::comm

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("all_to_all_single", &tp_ext::comm::all_to_all_single_op);
}
TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("all_to_all_single", &tp_ext::comm::all_to_all_single_op);
}
TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("all_to_all_single", &tp_ext::comm::all_to_all_single_autograd);
}
