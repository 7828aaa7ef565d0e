// Kernels of the plain collectives. The same code serves CPU and CUDA tensors: the
// process group's backend (gloo, NCCL) does the device work.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include "collectives.h"

namespace tp_ext::comm {
namespace {

at::Tensor all_reduce_op(const at::Tensor& x, c10::string_view reduce, c10::string_view group_name,
                         int64_t group_size) {
  auto g = resolve_group(group_name, group_size, x.device(), "all_reduce");
  return all_reduce(x, parse_reduce(reduce, "all_reduce"), g, "all_reduce");
}

at::Tensor all_gather_op(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                         c10::string_view group_name, int64_t group_size) {
  auto g = resolve_group(group_name, group_size, x.device(), "all_gather");
  return all_gather(x, dim, sizes, g, "all_gather");
}

at::Tensor reduce_scatter_op(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                             c10::string_view reduce, c10::string_view group_name,
                             int64_t group_size, int64_t group_rank) {
  auto g = resolve_group(group_name, group_size, x.device(), "reduce_scatter", group_rank);
  return reduce_scatter(x, dim, sizes, parse_reduce(reduce, "reduce_scatter"), g, "reduce_scatter");
}

at::Tensor broadcast_op(const at::Tensor& x, int64_t src, c10::string_view group_name,
                        int64_t group_size) {
  auto g = resolve_group(group_name, group_size, x.device(), "broadcast");
  return broadcast(x, src, g, "broadcast");
}

at::Tensor all_to_all_op(const at::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                         at::OptionalIntArrayRef sizes, c10::string_view group_name,
                         int64_t group_size, int64_t group_rank) {
  auto g = resolve_group(group_name, group_size, x.device(), "all_to_all", group_rank);
  return all_to_all(x, scatter_dim, gather_dim, sizes, g, "all_to_all");
}

// Autograd kernel of every plain collective: they have no gradient formula (the Megatron pairs
// do), so asking for one is an error that says what to use, not PyTorch's silent fallback.
void not_differentiable(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                        torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto n_args = schema.arguments().size();
  if (c10::GradMode::is_enabled()) {
    for (size_t i = 0; i < n_args; ++i) {
      const auto& arg = (*stack)[stack->size() - n_args + i];
      TORCH_CHECK_VALUE(!(arg.isTensor() && arg.toTensor().requires_grad()), "tp_ext.",
                        schema.name().substr(8), " is not differentiable, but ",
                        schema.arguments()[i].name(),
                        " requires grad. For training use the differentiable pairs in tp_ext.comm "
                        "(copy_to_tp, reduce_from_tp, scatter_to_tp, gather_from_tp, "
                        "gather_from_sp, reduce_scatter_to_sp), or pass x.detach().");
    }
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

// Sparse tensors reach this kernel (SparseCPU/SparseCUDA keys) instead of the dense ones.
void dense_only(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack*) {
  TORCH_CHECK_VALUE(false, "tp_ext.", op.schema().name().substr(8),
                    ": x must be a dense (strided) tensor, got a sparse one; call x.to_dense() "
                    "first.");
}

constexpr const char* kAllOps[] = {"all_reduce",     "all_gather",          "reduce_scatter",
                                   "broadcast",      "all_to_all",          "copy_to_tp",
                                   "reduce_from_tp", "scatter_to_tp",       "gather_from_tp",
                                   "gather_from_sp", "reduce_scatter_to_sp"};

void register_sparse_errors(torch::Library& m) {
  for (const char* name : kAllOps)
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&dense_only>());
}

void register_kernels(torch::Library& m) {
  m.impl("all_reduce", &all_reduce_op);
  m.impl("all_gather", &all_gather_op);
  m.impl("reduce_scatter", &reduce_scatter_op);
  m.impl("broadcast", &broadcast_op);
  m.impl("all_to_all", &all_to_all_op);
}

}  // namespace
}  // namespace tp_ext::comm

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) { tp_ext::comm::register_kernels(m); }
TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) { tp_ext::comm::register_kernels(m); }

TORCH_LIBRARY_IMPL(tp_ext, SparseCPU, m) { tp_ext::comm::register_sparse_errors(m); }
TORCH_LIBRARY_IMPL(tp_ext, SparseCUDA, m) { tp_ext::comm::register_sparse_errors(m); }

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  for (const char* name : {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&tp_ext::comm::not_differentiable>());
}
