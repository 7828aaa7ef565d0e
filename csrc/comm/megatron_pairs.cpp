// The Megatron communication pairs as differentiable ops. Each pair is a forward step and a
// backward step drawn from {identity, all-reduce, split, all-gather, reduce-scatter}; one autograd
// Function implements all six from the table below.
//
// The backward calls the registered tp_ext collectives through the dispatcher (never c10d
// directly), so torch.compile / AOTAutograd trace them into the backward graph.
#include <torch/autograd.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/dispatch.h"
#include "collectives.h"

namespace tp_ext::comm {
namespace {

enum class Step { Identity, AllReduce, Split, AllGather, ReduceScatter };

enum class Pair {
  CopyToTp,
  ReduceFromTp,
  ScatterToTp,
  GatherFromTp,
  GatherFromSp,
  ReduceScatterToSp
};

struct PairSpec {
  const char* name;
  Step forward;
  Step backward;
};

// Indexed by Pair.
constexpr PairSpec kPairs[] = {
    {"copy_to_tp", Step::Identity, Step::AllReduce},
    {"reduce_from_tp", Step::AllReduce, Step::Identity},
    {"scatter_to_tp", Step::Split, Step::AllGather},
    {"gather_from_tp", Step::AllGather, Step::Split},
    {"gather_from_sp", Step::AllGather, Step::ReduceScatter},
    {"reduce_scatter_to_sp", Step::ReduceScatter, Step::AllGather},
};

const PairSpec& spec(Pair p) { return kPairs[static_cast<int>(p)]; }

// Forward kernels (CPU and CUDA): run the pair's forward step.
at::Tensor run_forward(Pair p, const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                       c10::string_view group_name, int64_t group_size, int64_t group_rank) {
  const auto& s = spec(p);
  auto g = resolve_group(group_name, group_size, x.device(), s.name, group_rank);
  switch (s.forward) {
    case Step::Identity:
      check_tensor(x, "x", s.name);
      return x.clone();  // an op's output may not alias its input
    case Step::AllReduce:
      return all_reduce(x, Reduce::Sum, g, s.name);
    case Step::Split:
      return local_piece(x, dim, sizes, g, s.name);
    case Step::AllGather:
      return all_gather(x, dim, sizes, g, s.name);
    case Step::ReduceScatter:
      return reduce_scatter(x, dim, sizes, Reduce::Sum, g, s.name);
  }
  TORCH_CHECK(false, "unreachable");
}

template <Pair P>
at::Tensor forward_kernel(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                          c10::string_view group_name, int64_t group_size, int64_t group_rank) {
  return run_forward(P, x, dim, sizes, group_name, group_size, group_rank);
}

template <Pair P>
at::Tensor forward_kernel_nodim(const at::Tensor& x, c10::string_view group_name,
                                int64_t group_size) {
  return run_forward(P, x, 0, c10::nullopt, group_name, group_size, -1);
}

using DimOpSig = at::Tensor(const at::Tensor&, int64_t, at::OptionalIntArrayRef, c10::string_view,
                            int64_t, int64_t);
using GatherSig = at::Tensor(const at::Tensor&, int64_t, at::OptionalIntArrayRef, c10::string_view,
                             int64_t);
using NoDimOpSig = at::Tensor(const at::Tensor&, c10::string_view, int64_t);

bool has_dim(Pair p) { return p != Pair::CopyToTp && p != Pair::ReduceFromTp; }

// Calls the pair's own op below the autograd key (so its forward kernel, or a fake kernel while
// tracing, produces the output).
at::Tensor call_below_autograd(Pair p, const at::Tensor& x, int64_t dim,
                               at::OptionalIntArrayRef sizes, c10::string_view group_name,
                               int64_t group_size, int64_t group_rank) {
  at::AutoDispatchBelowADInplaceOrView guard;
  const auto handle = op_handle(spec(p).name);
  if (has_dim(p))
    return handle.typed<DimOpSig>().call(x, dim, sizes, group_name, group_size, group_rank);
  return handle.typed<NoDimOpSig>().call(x, group_name, group_size);
}

// Every step is a registered op, so the backward graph says which rank it is for (see
// schemas.cpp) and the rank-dependent slicing happens inside the op at run time.
at::Tensor run_backward_step(Step step, const at::Tensor& grad, int64_t dim,
                             at::OptionalIntArrayRef sizes, const std::string& group_name,
                             int64_t group_size, int64_t group_rank) {
  using ReduceSig = at::Tensor(const at::Tensor&, c10::string_view, c10::string_view, int64_t);
  using ScatterSig = at::Tensor(const at::Tensor&, int64_t, at::OptionalIntArrayRef,
                                c10::string_view, c10::string_view, int64_t, int64_t);
  switch (step) {
    case Step::Identity:
      return grad;
    case Step::AllReduce:
      return op_handle("all_reduce").typed<ReduceSig>().call(grad, "sum", group_name, group_size);
    case Step::AllGather:
      return op_handle("all_gather")
          .typed<GatherSig>()
          .call(grad, dim, sizes, group_name, group_size);
    case Step::ReduceScatter:
      return op_handle("reduce_scatter")
          .typed<ScatterSig>()
          .call(grad, dim, sizes, "sum", group_name, group_size, group_rank);
    case Step::Split: {  // scatter_to_tp's forward is exactly this split (under no_grad here)
      at::AutoDispatchBelowADInplaceOrView guard;
      return op_handle("scatter_to_tp")
          .typed<DimOpSig>()
          .call(grad, dim, sizes, group_name, group_size, group_rank);
    }
  }
  TORCH_CHECK(false, "unreachable");
}

class MegatronPair : public torch::autograd::Function<MegatronPair> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t pair, int64_t dim, c10::optional<std::vector<int64_t>> sizes,
                            const std::string& group_name, int64_t group_size, int64_t group_rank) {
    ctx->saved_data["pair"] = pair;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["sizes"] = sizes.has_value() ? c10::IValue(*sizes) : c10::IValue();
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["group_rank"] = group_rank;
    at::OptionalIntArrayRef sizes_ref =
        sizes.has_value() ? at::OptionalIntArrayRef(*sizes) : at::OptionalIntArrayRef(c10::nullopt);
    return call_below_autograd(static_cast<Pair>(pair), x, dim, sizes_ref, group_name, group_size,
                               group_rank);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto p = static_cast<Pair>(ctx->saved_data["pair"].toInt());
    const auto sizes_iv = ctx->saved_data["sizes"];
    std::vector<int64_t> sizes_vec;
    at::OptionalIntArrayRef sizes = c10::nullopt;
    if (!sizes_iv.isNone()) {
      sizes_vec = sizes_iv.toIntVector();
      sizes = sizes_vec;
    }
    auto grad_x = run_backward_step(spec(p).backward, grads[0], ctx->saved_data["dim"].toInt(),
                                    sizes, ctx->saved_data["group_name"].toStringRef(),
                                    ctx->saved_data["group_size"].toInt(),
                                    ctx->saved_data["group_rank"].toInt());
    return {grad_x,       at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

c10::optional<std::vector<int64_t>> to_vec(at::OptionalIntArrayRef sizes) {
  if (!sizes.has_value()) return c10::nullopt;
  return sizes->vec();
}

template <Pair P>
at::Tensor autograd_kernel(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                           c10::string_view group_name, int64_t group_size, int64_t group_rank) {
  return MegatronPair::apply(x, static_cast<int64_t>(P), dim, to_vec(sizes),
                             std::string(group_name), group_size, group_rank);
}

template <Pair P>
at::Tensor autograd_kernel_nodim(const at::Tensor& x, c10::string_view group_name,
                                 int64_t group_size) {
  return MegatronPair::apply(x, static_cast<int64_t>(P), int64_t{0},
                             c10::optional<std::vector<int64_t>>(), std::string(group_name),
                             group_size, int64_t{-1});
}

void register_forward_kernels(torch::Library& m) {
  m.impl("copy_to_tp", &forward_kernel_nodim<Pair::CopyToTp>);
  m.impl("reduce_from_tp", &forward_kernel_nodim<Pair::ReduceFromTp>);
  m.impl("scatter_to_tp", &forward_kernel<Pair::ScatterToTp>);
  m.impl("gather_from_tp", &forward_kernel<Pair::GatherFromTp>);
  m.impl("gather_from_sp", &forward_kernel<Pair::GatherFromSp>);
  m.impl("reduce_scatter_to_sp", &forward_kernel<Pair::ReduceScatterToSp>);
}

}  // namespace
}  // namespace tp_ext::comm

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) { tp_ext::comm::register_forward_kernels(m); }
TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) { tp_ext::comm::register_forward_kernels(m); }

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  using tp_ext::comm::Pair;
  m.impl("copy_to_tp", &tp_ext::comm::autograd_kernel_nodim<Pair::CopyToTp>);
  m.impl("reduce_from_tp", &tp_ext::comm::autograd_kernel_nodim<Pair::ReduceFromTp>);
  m.impl("scatter_to_tp", &tp_ext::comm::autograd_kernel<Pair::ScatterToTp>);
  m.impl("gather_from_tp", &tp_ext::comm::autograd_kernel<Pair::GatherFromTp>);
  m.impl("gather_from_sp", &tp_ext::comm::autograd_kernel<Pair::GatherFromSp>);
  m.impl("reduce_scatter_to_sp", &tp_ext::comm::autograd_kernel<Pair::ReduceScatterToSp>);
}
