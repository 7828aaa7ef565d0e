// Linear layers fused with their tensor-parallel communication, so that it hides behind GEMMs
// (Megatron-Core's overlap of the input-gradient all-reduce with the weight-gradient GEMM;
// PyTorch's async TP and xformers' ring-decomposed all-gather + matmul and matmul +
// reduce-scatter).
//
// column_linear: y = x W^T + b of a column-parallel layer whose input is replicated (forward: no
//   communication). It saves x itself for backward, where copy_to_tp + linear would save
//   copy_to_tp's fresh output: one copy of the input per column-parallel sibling (q, k, v, ...),
//   so the layers take this op at TP > 1 with overlap on or off. Backward
//   (column_linear_backward): grad_x = grad W first; with overlap its all-reduce is started,
//   grad_W = grad^T x and grad_b computed while it is in flight, then it is waited for; without,
//   it is a blocking all-reduce (on one host the shared-memory channel beats the overlapped
//   transfers, which take the process group's sockets).
// column_linears: column_linear for several column-parallel layers reading one input (q, k and v;
//   gate and up): y_i = x W_i^T + b_i. Backward (column_linears_backward): grad_x = sum_i grad_i
//   W_i, its one all-reduce in flight (with overlap) during every layer's weight-gradient GEMM,
//   where separate column_linear calls would all-reduce one input gradient per layer.
// all_gather_linear: y = gather(x) W^T + b under sequence parallelism, x this rank's shard along
//   `dim`. A ring of w steps: at step i the rank holds shard (rank - i) mod w; it passes it on to
//   rank + 1 and receives the next from rank - 1 while it multiplies the one it holds. Returns
//   (y, gathered x): the unfused layer saves the gathered input for backward too. Backward
//   (all_gather_linear_backward): grad_x = reduce_scatter(grad W) by the accumulator ring below,
//   grad_W = grad^T x_full and grad_b computed while its last transfer is in flight.
// linear_reduce_scatter: y = reduce_scatter(x W^T) along `dim` (row-parallel under SP). A ring of
//   accumulators: shard j's partial sum starts at rank j + 1 and travels j+1 -> j+2 -> ... -> j,
//   each rank adding its partial x[shard j] W^T, computed while the previous transfer is in
//   flight. Backward (linear_reduce_scatter_backward): the gradient's shards go round the ring
//   (an all-gather); with each shard the rank computes its rows of grad_x = grad W and adds
//   grad_shard^T x_shard to grad_W, while the next shard travels.
//
// Accounting records the unfused collective's bytes (stats.h) under the fused op's name, so
// tp_ext.comm.track() shows which path ran and that the volume is Megatron's minimum; its
// seconds are the time spent waiting for transfers: the communication the GEMMs did not hide.
#include <torch/autograd.h>
#include <torch/library.h>

#include <numeric>
#include <optional>

#include "../common/checks.h"
#include "../common/dispatch.h"
#include "../common/gemm.h"
#include "../common/group.h"
#include "collectives.h"
#include "stats.h"

namespace tp_ext::comm {
namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

int64_t nbytes(at::IntArrayRef shape, const at::Tensor& like) {
  int64_t n = like.element_size();
  for (int64_t d : shape) n *= d;
  return n;
}

// Shard r's [offset, offset + size) along the sequence dimension.
struct Shards {
  std::vector<int64_t> size, offset;
  int64_t total = 0;
};

Shards shards_of(std::vector<int64_t> sizes) {
  Shards s;
  s.size = std::move(sizes);
  for (int64_t n : s.size) {
    s.offset.push_back(s.total);
    s.total += n;
  }
  return s;
}

int64_t mod(int64_t a, int64_t w) { return ((a % w) + w) % w; }

// [tokens, features] view (a copy when the slice is not contiguous).
at::Tensor rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

int64_t sequence_dim(const at::Tensor& x, int64_t dim, const char* op) {
  dim = wrap_dim(dim, x.dim(), "dim", op);
  TORCH_CHECK_VALUE(dim != x.dim() - 1, "tp_ext.", op, ": dim=", dim,
                    " is the feature dimension; pass the sequence dimension (e.g. -2).");
  return dim;
}

// The checked arguments of a ring op: its sequence dim, group and shards.
struct RingCall {
  int64_t dim;
  Group g;
  Shards sh;
};

RingCall ring_call(const at::Tensor& x, const at::Tensor& weight, int64_t dim,
                   at::OptionalIntArrayRef sizes, c10::string_view group_name, int64_t group_size,
                   int64_t group_rank, bool x_is_full, const char* op) {
  check_linear(x, weight, std::nullopt, op);
  dim = sequence_dim(x, dim, op);
  auto g = resolve_group(group_name, group_size, x.device(), op, group_rank);
  auto sh = shards_of(rank_sizes(x, dim, sizes, g, x_is_full, op));
  return {dim, std::move(g), std::move(sh)};
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t dim, int64_t n_dim, int64_t features) {
  auto v = x.sizes().vec();
  v[dim] = n_dim;
  v.back() = features;
  return v;
}

// ---- column_linear: the input-gradient all-reduce behind the weight-gradient GEMM -------------

at::Tensor column_linear_kernel(const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, c10::string_view group_name,
                                int64_t group_size, bool /*overlap: backward's*/) {
  constexpr const char* op = "column_linear";
  check_linear(x, weight, bias, op);
  resolve_group(group_name, group_size, x.device(), op);  // checked, as every TP op
  return tp_ext::linear(x, weight, bias.has_value() ? *bias : at::Tensor());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> column_linear_backward_kernel(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
    c10::string_view group_name, int64_t group_size, bool overlap) {
  constexpr const char* op = "column_linear_backward";
  check_linear(x, weight, std::nullopt, op);
  const auto g = resolve_group(group_name, group_size, x.device(), op);
  const auto g2 = rows(grad);
  if (!overlap) {
    auto grad_x = all_reduce(tp_ext::matmul(grad, weight), Reduce::Sum, g, op);
    return {grad_x, tp_ext::matmul(g2.t(), rows(x)), g2.sum(0)};
  }
  // The input gradient first, its all-reduce in flight during the weight-gradient GEMM.
  auto pending = all_reduce_start(tp_ext::matmul(grad, weight), g, op);
  auto grad_w = tp_ext::matmul(g2.t(), rows(x));
  auto grad_b = g2.sum(0);
  return {finish(pending), grad_w, grad_b};
}

// ---- column_linears: one all-reduce for the summed input gradient of several layers ------------

void check_column_group(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                        const char* op) {
  TORCH_CHECK_VALUE(!weights.empty(), "tp_ext.", op, ": weights is empty; pass one [out_i, ",
                    "in] weight per layer.");
  TORCH_CHECK_VALUE(biases.empty() || biases.size() == weights.size(), "tp_ext.", op,
                    ": biases has ", biases.size(), " tensors for ", weights.size(),
                    " weights; pass one bias per weight, or none.");
  for (size_t i = 0; i < weights.size(); ++i) {
    check_linear(x, weights[i], biases.empty() ? std::nullopt : std::optional(biases[i]), op);
  }
}

std::vector<at::Tensor> column_linears_kernel(const at::Tensor& x, at::TensorList weights,
                                              at::TensorList biases, c10::string_view group_name,
                                              int64_t group_size, bool /*overlap: backward's*/) {
  constexpr const char* op = "column_linears";
  check_column_group(x, weights, biases, op);
  resolve_group(group_name, group_size, x.device(), op);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < weights.size(); ++i)
    out.push_back(tp_ext::linear(x, weights[i], biases.empty() ? at::Tensor() : biases[i]));
  return out;
}

// The weight (and bias) gradients of every layer: run while the input gradient's all-reduce is in
// flight.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> column_group_weight_grads(
    at::TensorList grads, const at::Tensor& x, bool bias) {
  std::vector<at::Tensor> grad_w, grad_b;
  const auto x2 = rows(x);
  for (const auto& grad : grads) {
    const auto g2 = rows(grad);
    grad_w.push_back(tp_ext::matmul(g2.t(), x2));
    if (bias) grad_b.push_back(g2.sum(0));
  }
  return {grad_w, grad_b};
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>
column_linears_backward_kernel(at::TensorList grads, const at::Tensor& x, at::TensorList weights,
                               bool bias, c10::string_view group_name, int64_t group_size,
                               bool overlap) {
  constexpr const char* op = "column_linears_backward";
  check_column_group(x, weights, {}, op);
  TORCH_CHECK_VALUE(grads.size() == weights.size(), "tp_ext.", op, ": ", grads.size(),
                    " gradients for ", weights.size(), " weights; pass one per layer output.");
  const auto g = resolve_group(group_name, group_size, x.device(), op);
  auto grad_x = tp_ext::matmul(grads[0], weights[0]);  // contiguous: its [tokens, in] view is too
  auto grad_rows = grad_x.view({-1, grad_x.size(-1)});
  for (size_t i = 1; i < weights.size(); ++i)
    tp_ext::add_matmul_(grad_rows, rows(grads[i]), weights[i]);
  if (!overlap) {
    grad_x = all_reduce(grad_x, Reduce::Sum, g, op);
    auto [grad_w, grad_b] = column_group_weight_grads(grads, x, bias);
    return {grad_x, grad_w, grad_b};
  }
  auto pending = all_reduce_start(grad_x, g, op);
  auto [grad_w, grad_b] = column_group_weight_grads(grads, x, bias);
  return {finish(pending), grad_w, grad_b};
}

// ---- all_gather_linear: ring all-gather, each shard multiplied while the next travels ----------

std::tuple<at::Tensor, at::Tensor> all_gather_linear_kernel(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    int64_t dim, at::OptionalIntArrayRef sizes, c10::string_view group_name, int64_t group_size,
    int64_t group_rank) {
  constexpr const char* op = "all_gather_linear";
  check_linear(x, weight, bias, op);
  const RingCall call =
      ring_call(x, weight, dim, sizes, group_name, group_size, group_rank, false, op);
  const Group& g = call.g;
  const Shards& sh = call.sh;
  dim = call.dim;
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  auto full = at::empty(out_shape(x, dim, sh.total, x.size(-1)), x.options());
  auto y = at::empty(out_shape(x, dim, sh.total, weight.size(0)), x.options());
  ring_announce(x, dim, sh.size, 1, g, op);
  const int64_t w = g.size;
  auto cur = x.contiguous();
  double waited = 0;
  for (int64_t i = 0; i < w; ++i) {
    const int64_t j = mod(g.rank - i, w);  // whose shard `cur` is
    RingShift shift;
    at::Tensor next;
    if (i + 1 < w) {
      next = at::empty(out_shape(x, dim, sh.size[mod(j - 1, w)], x.size(-1)), x.options());
      shift = ring_shift_start(cur, next, i, g);
    }
    full.narrow(dim, sh.offset[j], sh.size[j]).copy_(cur);
    y.narrow(dim, sh.offset[j], sh.size[j]).copy_(tp_ext::linear(cur, weight, b));
    if (i + 1 < w) {
      waited += ring_shift_finish(shift, g, op);
      cur = next;
    }
  }
  if (w > 1) record(op, "all_gather", nbytes(full), waited);
  return {y, full};
}

// The accumulator ring: shard j of the sum over ranks of partial(j) ends on rank j. partial(j) is
// this rank's term for shard j ([..., size_j, features], a fresh tensor), shape(j) its shape;
// `overlapped` runs during the last transfer. Returns this rank's shard of the sum.
template <typename Partial, typename Shape, typename Overlapped>
at::Tensor accumulate_ring(const Group& g, const char* op, Partial partial, Shape shape,
                           Overlapped overlapped, int64_t full_bytes) {
  const int64_t w = g.size;
  double waited = 0;
  RingShift shift;
  at::Tensor sent, incoming;
  for (int64_t i = 0; i < w; ++i) {
    const int64_t j = mod(g.rank - 1 - i, w);  // the shard whose sum passes through here now
    auto mine = partial(j);                    // while the previous step's transfer is in flight
    if (i + 1 == w) overlapped();
    if (i > 0) {
      waited += ring_shift_finish(shift, g, op);
      mine.add_(incoming);
    }
    if (i + 1 == w) {
      if (w > 1) record(op, "reduce_scatter", full_bytes, waited);
      return mine;
    }
    sent = mine;  // alive until its send has been waited for
    incoming = at::empty(shape(mod(j - 1, w)), mine.options());
    shift = ring_shift_start(sent, incoming, i, g);
  }
  TORCH_CHECK(false, "unreachable");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> all_gather_linear_backward_kernel(
    const at::Tensor& grad, const at::Tensor& x_full, const at::Tensor& weight, int64_t dim,
    at::OptionalIntArrayRef sizes, c10::string_view group_name, int64_t group_size,
    int64_t group_rank) {
  constexpr const char* op = "all_gather_linear_backward";
  const RingCall call =
      ring_call(x_full, weight, dim, sizes, group_name, group_size, group_rank, true, op);
  const Group& g = call.g;
  const Shards& sh = call.sh;
  dim = call.dim;
  ring_announce(x_full, -1, sh.size, 2, g, op);
  at::Tensor grad_w, grad_b;
  auto grad_x = accumulate_ring(g, op, [&](int64_t j) {
    return tp_ext::matmul(grad.narrow(dim, sh.offset[j], sh.size[j]), weight).contiguous();
  }, [&](int64_t j) { return out_shape(x_full, dim, sh.size[j], x_full.size(-1)); }, [&] {
    const auto g2 = rows(grad);
    grad_w = tp_ext::matmul(g2.t(), rows(x_full));
    grad_b = g2.sum(0);
  }, nbytes(x_full));
  return {grad_x, grad_w, grad_b};
}

// ---- linear_reduce_scatter: the accumulator ring, each partial computed while one travels ------

at::Tensor linear_reduce_scatter_kernel(const at::Tensor& x, const at::Tensor& weight, int64_t dim,
                                        at::OptionalIntArrayRef sizes, c10::string_view group_name,
                                        int64_t group_size, int64_t group_rank) {
  constexpr const char* op = "linear_reduce_scatter";
  const RingCall call =
      ring_call(x, weight, dim, sizes, group_name, group_size, group_rank, true, op);
  const Group& g = call.g;
  const Shards& sh = call.sh;
  dim = call.dim;
  // the input's features are this rank's share: agree on the output's shape
  ring_announce(at::zeros({1}, x.options()).expand(out_shape(x, dim, sh.total, weight.size(0))), -1,
                sh.size, 3, g, op);
  return accumulate_ring(g, op, [&](int64_t j) {
    return tp_ext::linear(x.narrow(dim, sh.offset[j], sh.size[j]), weight);
  }, [&](int64_t j) { return out_shape(x, dim, sh.size[j], weight.size(0)); }, [] {
  }, nbytes(out_shape(x, dim, sh.total, weight.size(0)), x));
}

std::tuple<at::Tensor, at::Tensor> linear_reduce_scatter_backward_kernel(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, int64_t dim,
    at::OptionalIntArrayRef sizes, c10::string_view group_name, int64_t group_size,
    int64_t group_rank) {
  constexpr const char* op = "linear_reduce_scatter_backward";
  const RingCall call =
      ring_call(x, weight, dim, sizes, group_name, group_size, group_rank, true, op);
  const Group& g = call.g;
  const Shards& sh = call.sh;
  dim = call.dim;
  TORCH_CHECK_VALUE(grad.size(dim) == sh.size[g.rank] && grad.size(-1) == weight.size(0), "tp_ext.",
                    op, ": grad has shape ", shape_str(grad.sizes()),
                    "; this rank's output shard is ",
                    shape_str(out_shape(x, dim, sh.size[g.rank], weight.size(0))), ".");
  ring_announce(grad, dim, sh.size, 4, g, op);
  // The gradient's shards go round the ring; each one's rows of grad_x and its term of grad_W
  // are computed while the next travels.
  auto grad_x = at::empty(x.sizes(), x.options());
  // bf16 / fp16: the weight gradient's terms are summed in fp32 and rounded once, as the unfused
  // path's single GEMM over the gathered gradient does (a bf16 sum would round at every step).
  const bool reduced = at::isReducedFloatingType(weight.scalar_type());
  const auto acc = reduced ? at::kFloat : weight.scalar_type();
  auto grad_w = at::zeros(weight.sizes(), weight.options().dtype(acc));
  const int64_t w = g.size;
  auto cur = grad.contiguous();
  double waited = 0;
  for (int64_t i = 0; i < w; ++i) {
    const int64_t j = mod(g.rank - i, w);
    RingShift shift;
    at::Tensor next;
    if (i + 1 < w) {
      next = at::empty(out_shape(x, dim, sh.size[mod(j - 1, w)], weight.size(0)), grad.options());
      shift = ring_shift_start(cur, next, i, g);
    }
    const auto x_j = x.narrow(dim, sh.offset[j], sh.size[j]);
    grad_x.narrow(dim, sh.offset[j], sh.size[j]).copy_(tp_ext::matmul(cur, weight));
    tp_ext::add_matmul_(grad_w, rows(cur).t().to(acc), rows(x_j).to(acc));
    if (i + 1 < w) {
      waited += ring_shift_finish(shift, g, op);
      cur = next;
    }
  }
  if (w > 1)
    record(op, "all_gather", nbytes(out_shape(x, dim, sh.total, weight.size(0)), grad), waited);
  return {grad_x, reduced ? grad_w.to(weight.scalar_type()) : grad_w};
}

// ---- autograd (C++): the backward ops through the dispatcher, so compile traces them ----------

using ColumnBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view, int64_t, bool);
using GatherBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, at::OptionalIntArrayRef,
    c10::string_view, int64_t, int64_t);
using ScatterBackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, int64_t,
                                                              at::OptionalIntArrayRef,
                                                              c10::string_view, int64_t, int64_t);
using ColumnSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             c10::string_view, int64_t, bool);
using GatherSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                     const std::optional<at::Tensor>&, int64_t,
                                                     at::OptionalIntArrayRef, c10::string_view,
                                                     int64_t, int64_t);
using ScatterSig = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                              at::OptionalIntArrayRef, c10::string_view, int64_t, int64_t);

at::OptionalIntArrayRef sizes_of(const c10::IValue& v, std::vector<int64_t>& keep) {
  if (v.isNone()) return c10::nullopt;
  keep = v.toIntVector();
  return keep;
}

c10::IValue sizes_value(at::OptionalIntArrayRef sizes) {
  return sizes.has_value() ? c10::IValue(sizes->vec()) : c10::IValue();
}

// What the column ops' backward needs besides tensors.
void save_column_call(torch::autograd::AutogradContext* ctx, const std::string& group_name,
                      int64_t group_size, bool overlap) {
  ctx->saved_data["group_name"] = group_name;
  ctx->saved_data["group_size"] = group_size;
  ctx->saved_data["overlap"] = overlap;
}

class ColumnLinear : public torch::autograd::Function<ColumnLinear> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::string& group_name, int64_t group_size, bool overlap) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.has_value();
    save_column_call(ctx, group_name, group_size, overlap);
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = op_handle("column_linear").typed<ColumnSig>();
    return op.call(x, weight, bias, group_name, group_size, overlap);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    if (!ctx->needs_input_grad(0)) {
      // No input gradient wanted (e.g. a frozen embedding below): the weight gradients alone,
      // with no all-reduce. Every TP rank runs the same program, so all skip it alike.
      const auto g2 = rows(grads[0]);
      return {at::Tensor(),
              tp_ext::matmul(g2.t(), rows(saved[0])),
              d.at("has_bias").toBool() ? g2.sum(0) : at::Tensor(),
              at::Tensor(),
              at::Tensor(),
              at::Tensor()};
    }
    static const auto op = op_handle("column_linear_backward").typed<ColumnBackwardSig>();
    auto [gx, gw, gb] = op.call(grads[0], saved[0], saved[1], d.at("group_name").toStringRef(),
                                d.at("group_size").toInt(), d.at("overlap").toBool());
    return {gx,           gw,           d.at("has_bias").toBool() ? gb : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

using ColumnsSig = std::vector<at::Tensor>(const at::Tensor&, at::TensorList, at::TensorList,
                                           c10::string_view, int64_t, bool);
using ColumnsBackwardSig = std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>(
    at::TensorList, const at::Tensor&, at::TensorList, bool, c10::string_view, int64_t, bool);

// Inputs as autograd counts them: x, then each weight, then each bias (the lists flattened), then
// the three non-tensor arguments.
class ColumnLinears : public torch::autograd::Function<ColumnLinears> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, at::TensorList weights,
                                                at::TensorList biases,
                                                const std::string& group_name, int64_t group_size,
                                                bool overlap) {
    std::vector<at::Tensor> saved{x};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["bias"] = !biases.empty();
    save_column_call(ctx, group_name, group_size, overlap);
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = op_handle("column_linears").typed<ColumnsSig>();
    return op.call(x, weights, biases, group_name, group_size, overlap);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const bool bias = d.at("bias").toBool();
    const at::Tensor& x = saved[0];
    const std::vector<at::Tensor> weights(saved.begin() + 1, saved.end());
    at::Tensor grad_x;
    std::vector<at::Tensor> grad_w, grad_b;
    if (ctx->needs_input_grad(0)) {
      static const auto op = op_handle("column_linears_backward").typed<ColumnsBackwardSig>();
      std::tie(grad_x, grad_w, grad_b) =
          op.call(grads, x, weights, bias, d.at("group_name").toStringRef(),
                  d.at("group_size").toInt(), d.at("overlap").toBool());
    } else {  // no input gradient wanted: no all-reduce (every TP rank skips it alike)
      std::tie(grad_w, grad_b) = column_group_weight_grads(grads, x, bias);
    }
    torch::autograd::variable_list out{grad_x};
    out.insert(out.end(), grad_w.begin(), grad_w.end());
    out.insert(out.end(), grad_b.begin(), grad_b.end());
    out.resize(out.size() + 3);  // group_name, group_size, overlap
    return out;
  }
};

class AllGatherLinear : public torch::autograd::Function<AllGatherLinear> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias, int64_t dim,
                                                c10::IValue sizes, const std::string& group_name,
                                                int64_t group_size, int64_t group_rank) {
    std::vector<int64_t> keep;
    const auto s = sizes_of(sizes, keep);
    at::Tensor y, full;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      static const auto op = op_handle("all_gather_linear").typed<GatherSig>();
      std::tie(y, full) = op.call(x, weight, bias, dim, s, group_name, group_size, group_rank);
    }
    ctx->save_for_backward({full, weight});
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["group_rank"] = group_rank;
    ctx->mark_non_differentiable({full});
    return {y, full};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    std::vector<int64_t> keep;
    static const auto op = op_handle("all_gather_linear_backward").typed<GatherBackwardSig>();
    auto [gx, gw, gb] = op.call(grads[0], saved[0], saved[1], d.at("dim").toInt(),
                                sizes_of(d.at("sizes"), keep), d.at("group_name").toStringRef(),
                                d.at("group_size").toInt(), d.at("group_rank").toInt());
    return {gx,           gw,           d.at("has_bias").toBool() ? gb : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

class LinearReduceScatter : public torch::autograd::Function<LinearReduceScatter> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, int64_t dim, c10::IValue sizes,
                            const std::string& group_name, int64_t group_size, int64_t group_rank) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["group_rank"] = group_rank;
    std::vector<int64_t> keep;
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = op_handle("linear_reduce_scatter").typed<ScatterSig>();
    return op.call(x, weight, dim, sizes_of(sizes, keep), group_name, group_size, group_rank);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    std::vector<int64_t> keep;
    static const auto op = op_handle("linear_reduce_scatter_backward").typed<ScatterBackwardSig>();
    auto [gx, gw] = op.call(grads[0], saved[0], saved[1], d.at("dim").toInt(),
                            sizes_of(d.at("sizes"), keep), d.at("group_name").toStringRef(),
                            d.at("group_size").toInt(), d.at("group_rank").toInt());
    return {gx, gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor column_linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias,
                                  c10::string_view group_name, int64_t group_size, bool overlap) {
  return ColumnLinear::apply(x, weight, bias, std::string(group_name), group_size, overlap);
}

std::vector<at::Tensor> column_linears_autograd(const at::Tensor& x, at::TensorList weights,
                                                at::TensorList biases, c10::string_view group_name,
                                                int64_t group_size, bool overlap) {
  return ColumnLinears::apply(x, weights, biases, std::string(group_name), group_size, overlap);
}

std::tuple<at::Tensor, at::Tensor> all_gather_linear_autograd(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    int64_t dim, at::OptionalIntArrayRef sizes, c10::string_view group_name, int64_t group_size,
    int64_t group_rank) {
  // The gathered input (saved for backward) is an output too; it carries no gradient.
  auto out = AllGatherLinear::apply(x, weight, bias, dim, sizes_value(sizes),
                                    std::string(group_name), group_size, group_rank);
  return {out[0], out[1]};
}

at::Tensor linear_reduce_scatter_autograd(const at::Tensor& x, const at::Tensor& weight,
                                          int64_t dim, at::OptionalIntArrayRef sizes,
                                          c10::string_view group_name, int64_t group_size,
                                          int64_t group_rank) {
  return LinearReduceScatter::apply(x, weight, dim, sizes_value(sizes), std::string(group_name),
                                    group_size, group_rank);
}

void register_kernels(torch::Library& m) {
  m.impl("column_linear", &column_linear_kernel);
  m.impl("column_linear_backward", &column_linear_backward_kernel);
  m.impl("column_linears", &column_linears_kernel);
  m.impl("column_linears_backward", &column_linears_backward_kernel);
  m.impl("all_gather_linear", &all_gather_linear_kernel);
  m.impl("all_gather_linear_backward", &all_gather_linear_backward_kernel);
  m.impl("linear_reduce_scatter", &linear_reduce_scatter_kernel);
  m.impl("linear_reduce_scatter_backward", &linear_reduce_scatter_backward_kernel);
}

}  // namespace
}  // namespace tp_ext::comm

// Device-generic: the GEMMs dispatch to the tensors' device, the transfers go through the process
// group's backend (gloo: CPU; NCCL: CUDA, where send/recv run on NCCL's stream).
TORCH_LIBRARY_IMPL(tp_ext, CPU, m) { tp_ext::comm::register_kernels(m); }
TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) { tp_ext::comm::register_kernels(m); }

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("column_linear", &tp_ext::comm::column_linear_autograd);
  m.impl("column_linears", &tp_ext::comm::column_linears_autograd);
  m.impl("all_gather_linear", &tp_ext::comm::all_gather_linear_autograd);
  m.impl("linear_reduce_scatter", &tp_ext::comm::linear_reduce_scatter_autograd);
  // No double backward.
  for (const char* name : {"column_linear_backward", "column_linears_backward",
                           "all_gather_linear_backward", "linear_reduce_scatter_backward"})
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
}
