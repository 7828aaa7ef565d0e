// Token permutation for mixture-of-experts routing: the shared argument setup, the CPU kernels
// and the C++ autograd (CUDA kernels: moe_permute_cuda.cu).
//
//   moe_route(expert_ids [T, k], E) -> (row_map [T, k], counts [E])   a stable counting sort
//   moe_permute(x [T, H], row_map, weights?, R) -> [R, H]      out[row_map[t, j]] = w[t, j] x[t]
//   moe_unpermute(y [R, H], row_map, weights?) -> [T, H]       out[t] = sum_j w[t, j] y[row_map[t,
//   j]] moe_weight_grad(tokens [T, H], rows [R, H], row_map) -> [T, k]   dot(tokens[t],
//   rows[row_map])
// Permute and unpermute are adjoint (each is the other's backward), and both read or write whole
// rows, so each token is one task and no two tasks write the same row: no atomics, no sort.
// Math in fp32 (double for double), rounded once.
#include "moe_permute.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "../common/dispatch.h"

namespace tp_ext::ops {

at::Tensor checked_expert_ids(const at::Tensor& expert_ids, int64_t num_experts, const char* op) {
  check_tensor(expert_ids, "expert_ids", op);
  TORCH_CHECK_VALUE(num_experts >= 1, "tp_ext.", op, ": num_experts=", num_experts,
                    " must be at least 1.");
  TORCH_CHECK_VALUE(expert_ids.dim() == 2, "tp_ext.", op, ": expert_ids has shape ",
                    expert_ids.sizes(), "; it must be [tokens, top_k].");
  TORCH_CHECK_VALUE(at::isIntegralType(expert_ids.scalar_type(), /*includeBool=*/false), "tp_ext.",
                    op, ": expert_ids must be an integer tensor (topk's indices), got ",
                    expert_ids.scalar_type(), ".");
  return expert_ids.to(at::kLong).contiguous();
}

namespace {

at::Tensor checked_row_map(const at::Tensor& row_map, int64_t tokens, const char* op) {
  check_tensor(row_map, "row_map", op);
  TORCH_CHECK_VALUE(row_map.scalar_type() == at::kLong && row_map.dim() == 2, "tp_ext.", op,
                    ": row_map must be the int64 [tokens, top_k] tensor from moe_route, got ",
                    row_map.scalar_type(), " of shape ", row_map.sizes(), ".");
  TORCH_CHECK_VALUE(tokens < 0 || row_map.size(0) == tokens, "tp_ext.", op, ": row_map has ",
                    row_map.size(0), " tokens (shape ", row_map.sizes(),
                    ") but the token tensor has ", tokens, "; they must match.");
  return row_map.contiguous();
}

at::Tensor checked_weights(const at::Tensor& weights, const at::Tensor& row_map, const char* op) {
  if (!weights.defined()) return weights;
  check_tensor(weights, "weights", op);
  TORCH_CHECK_VALUE(at::isFloatingType(weights.scalar_type()), "tp_ext.", op,
                    ": weights must be floating point, got ", weights.scalar_type(), ".");
  TORCH_CHECK_VALUE(weights.sizes().equals(row_map.sizes()), "tp_ext.", op, ": weights has shape ",
                    weights.sizes(), " but row_map has shape ", row_map.sizes(),
                    "; they must match ([tokens, top_k]).");
  return weights.contiguous();
}

at::Tensor checked_rows(const at::Tensor& x, const char* arg, const char* op) {
  check_tensor(x, arg, op);
  TORCH_CHECK_VALUE(x.dim() == 2, "tp_ext.", op, ": ", arg, " has shape ", x.sizes(),
                    "; it must be 2-d [rows, hidden] (flatten batch and sequence first).");
  TORCH_CHECK_VALUE(at::isFloatingType(x.scalar_type()), "tp_ext.", op, ": ", arg,
                    " must be floating point, got ", x.scalar_type(), ".");
  return x.contiguous();
}

// Weights as fp32 (double for double rows), so the kernels read one type.
at::Tensor weights_for(const at::Tensor& weights, const at::Tensor& rows) {
  return weights.defined() ? weights.to(weight_grad_dtype(rows)).contiguous() : weights;
}

}  // namespace

at::ScalarType weight_grad_dtype(const at::Tensor& rows) {
  return rows.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

PermuteArgs permute_args(const at::Tensor& x_in, const at::Tensor& row_map_in,
                         const c10::optional<at::Tensor>& weights_in, int64_t num_rows) {
  const char* op = "moe_permute";
  auto x = checked_rows(x_in, "x", op);
  auto row_map = checked_row_map(row_map_in, x.size(0), op);
  auto weights = weights_for(checked_weights(weights_in.value_or(at::Tensor()), row_map, op), x);
  TORCH_CHECK_VALUE(num_rows >= 0, "tp_ext.", op, ": num_rows=", num_rows,
                    " must be >= 0 (tokens x top_k for dropless routing).");
  return {x, row_map, weights};
}

UnpermuteArgs unpermute_args(const at::Tensor& y_in, const at::Tensor& row_map_in,
                             const c10::optional<at::Tensor>& weights_in) {
  const char* op = "moe_unpermute";
  auto y = checked_rows(y_in, "y", op);
  auto row_map = checked_row_map(row_map_in, /*tokens=*/-1, op);
  auto weights = weights_for(checked_weights(weights_in.value_or(at::Tensor()), row_map, op), y);
  return {y, row_map, weights};
}

WeightGradArgs weight_grad_args(const at::Tensor& tokens_in, const at::Tensor& rows_in,
                                const at::Tensor& row_map_in) {
  const char* op = "moe_weight_grad";
  auto tokens = checked_rows(tokens_in, "tokens", op);
  auto rows = checked_rows(rows_in, "rows", op);
  TORCH_CHECK_VALUE(tokens.scalar_type() == rows.scalar_type() && tokens.size(1) == rows.size(1),
                    "tp_ext.", op, ": tokens (", tokens.scalar_type(), " ", tokens.sizes(),
                    ") and rows (", rows.scalar_type(), " ", rows.sizes(),
                    ") must have the same dtype and hidden size.");
  auto row_map = checked_row_map(row_map_in, tokens.size(0), op);
  return {tokens, rows, row_map};
}

namespace {

template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <typename T>
constexpr bool kReduced = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;
using FVec = at::vec::Vectorized<float>;

int64_t grain(int64_t hidden) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(hidden, 1)); }

// ---- row helpers: whole rows of `hidden` elements, vectorised (fp32 lanes for bf16 / fp16) ----

// acc[:] = 0
template <typename T>
void zero_acc(Acc<T>* acc, int64_t hidden) {
  std::memset(acc, 0, sizeof(Acc<T>) * hidden);
}

// acc[:] += w * src[:]
template <typename T>
void axpy(Acc<T>* acc, const T* src, Acc<T> w, int64_t hidden) {
  int64_t h = 0;
  if constexpr (kReduced<T>) {
    constexpr int64_t W = at::vec::Vectorized<T>::size();  // two fp32 vectors
    const FVec wv(w);
    for (; h + W <= hidden; h += W) {
      auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src + h));
      at::vec::fmadd(lo, wv, FVec::loadu(acc + h)).store(acc + h);
      at::vec::fmadd(hi, wv, FVec::loadu(acc + h + W / 2)).store(acc + h + W / 2);
    }
  } else {
    using V = at::vec::Vectorized<T>;
    const V wv(w);
    for (; h + V::size() <= hidden; h += V::size())
      at::vec::fmadd(V::loadu(src + h), wv, V::loadu(acc + h)).store(acc + h);
  }
  for (; h < hidden; ++h) acc[h] += w * static_cast<Acc<T>>(src[h]);
}

// dst[:] = acc[:], rounded once
template <typename T>
void store_acc(T* dst, const Acc<T>* acc, int64_t hidden) {
  if constexpr (kReduced<T>) {
    constexpr int64_t W = at::vec::Vectorized<T>::size();
    int64_t h = 0;
    for (; h + W <= hidden; h += W)
      at::vec::convert_from_float<T>(FVec::loadu(acc + h), FVec::loadu(acc + h + W / 2))
          .store(dst + h);
    for (; h < hidden; ++h) dst[h] = static_cast<T>(acc[h]);
  } else {
    std::memcpy(dst, acc, sizeof(T) * hidden);
  }
}

// dst[:] = w * src[:] (a copy when w is 1: no rounding at all)
template <typename T>
void scale_row(T* dst, const T* src, Acc<T> w, bool weighted, int64_t hidden, Acc<T>* scratch) {
  if (!weighted) {
    std::memcpy(dst, src, sizeof(T) * hidden);
    return;
  }
  zero_acc<T>(scratch, hidden);
  axpy<T>(scratch, src, w, hidden);
  store_acc<T>(dst, scratch, hidden);
}

template <typename V>
auto lane_sum(const V& v) {
  typename V::value_type lanes[V::size()];
  v.store(lanes);
  typename V::value_type total = 0;
  for (auto x : lanes) total += x;
  return total;
}

// sum a[:] * b[:]
template <typename T>
Acc<T> dot(const T* a, const T* b, int64_t hidden) {
  int64_t h = 0;
  Acc<T> total = 0;
  if constexpr (kReduced<T>) {
    constexpr int64_t W = at::vec::Vectorized<T>::size();
    FVec s(0.f);
    for (; h + W <= hidden; h += W) {
      auto [alo, ahi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(a + h));
      auto [blo, bhi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(b + h));
      s = at::vec::fmadd(alo, blo, s);
      s = at::vec::fmadd(ahi, bhi, s);
    }
    total = lane_sum(s);
  } else {
    using V = at::vec::Vectorized<T>;
    V s(0);
    for (; h + V::size() <= hidden; h += V::size())
      s = at::vec::fmadd(V::loadu(a + h), V::loadu(b + h), s);
    total = lane_sum(s);
  }
  for (; h < hidden; ++h) total += static_cast<Acc<T>>(a[h]) * static_cast<Acc<T>>(b[h]);
  return total;
}

// ---- kernels ----

std::tuple<at::Tensor, at::Tensor> moe_route_cpu(const at::Tensor& expert_ids_in,
                                                 int64_t num_experts) {
  const char* op = "moe_route";
  const auto ids = checked_expert_ids(expert_ids_in, num_experts, op);
  auto counts = at::zeros({num_experts}, ids.options());
  auto row_map = at::empty(ids.sizes(), ids.options());
  const int64_t n = ids.numel();
  const int64_t* e = ids.const_data_ptr<int64_t>();
  int64_t* c = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(e[i] >= -1 && e[i] < num_experts, "tp_ext.", op, ": expert_ids[",
                      i / ids.size(1), ", ", i % ids.size(1), "] = ", e[i],
                      " is not an expert; use 0 .. ", num_experts - 1,
                      ", or -1 for a dropped "
                      "token.");
    if (e[i] >= 0) ++c[e[i]];
  }
  std::vector<int64_t> next(num_experts, 0);  // first free row of each expert's block
  for (int64_t x = 1; x < num_experts; ++x) next[x] = next[x - 1] + c[x - 1];
  int64_t* r = row_map.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) r[i] = e[i] >= 0 ? next[e[i]]++ : -1;
  return {row_map, counts};
}

// Checks that every entry of row_map is -1 or a row in [0, num_rows), no row twice; returns how
// many rows are written (rows nobody writes are zeroed).
int64_t checked_targets(const at::Tensor& row_map, int64_t num_rows, const char* op) {
  const int64_t* r = row_map.const_data_ptr<int64_t>();
  std::vector<char> seen(num_rows, 0);
  int64_t written = 0;
  for (int64_t i = 0; i < row_map.numel(); ++i) {
    if (r[i] == -1) continue;
    TORCH_CHECK_VALUE(r[i] >= 0 && r[i] < num_rows, "tp_ext.", op, ": row_map holds ", r[i],
                      " at flat index ", i, "; entries must be -1 or rows in [0, ", num_rows,
                      ") (num_rows=", num_rows, ").");
    TORCH_CHECK_VALUE(!seen[r[i]], "tp_ext.", op, ": row_map sends two entries to row ", r[i],
                      "; each row takes one (token, choice): use moe_route's row_map.");
    seen[r[i]] = 1;
    ++written;
  }
  return written;
}

at::Tensor moe_permute_cpu(const at::Tensor& x_in, const at::Tensor& row_map_in,
                           const c10::optional<at::Tensor>& weights_in, int64_t num_rows) {
  const auto a = permute_args(x_in, row_map_in, weights_in, num_rows);
  const at::Tensor &x = a.x, &row_map = a.row_map, &weights = a.weights;
  const int64_t written = checked_targets(row_map, num_rows, "moe_permute");
  const int64_t tokens = x.size(0), k = row_map.size(1), hidden = x.size(1);
  auto out = written == num_rows ? at::empty({num_rows, hidden}, x.options())
                                 : at::zeros({num_rows, hidden}, x.options());
  if (written == 0 || hidden == 0) return out;
  TP_EXT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "moe_permute", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const int64_t* rp = row_map.const_data_ptr<int64_t>();
    const Acc<scalar_t>* wp = weights.defined() ? weights.const_data_ptr<Acc<scalar_t>>() : nullptr;
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain(hidden * k), [&](int64_t begin, int64_t end) {
      std::vector<Acc<scalar_t>> scratch(hidden);
      for (int64_t t = begin; t < end; ++t)
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = rp[t * k + j];
          if (r < 0) continue;
          scale_row<scalar_t>(op_ + r * hidden, xp + t * hidden, wp ? wp[t * k + j] : 1,
                              wp != nullptr, hidden, scratch.data());
        }
    });
  });
  return out;
}

// Every non-negative entry of row_map must be a row of y.
void check_sources(const at::Tensor& row_map, int64_t rows, const char* op) {
  const int64_t* r = row_map.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < row_map.numel(); ++i)
    TORCH_CHECK_VALUE(r[i] >= -1 && r[i] < rows, "tp_ext.", op, ": row_map holds ", r[i],
                      " at flat index ", i, " but there are ", rows,
                      " rows; entries must be -1 or rows in [0, ", rows, ").");
}

at::Tensor moe_unpermute_cpu(const at::Tensor& y_in, const at::Tensor& row_map_in,
                             const c10::optional<at::Tensor>& weights_in) {
  const auto a = unpermute_args(y_in, row_map_in, weights_in);
  const at::Tensor &y = a.y, &row_map = a.row_map, &weights = a.weights;
  check_sources(row_map, y.size(0), "moe_unpermute");
  const int64_t tokens = row_map.size(0), k = row_map.size(1), hidden = y.size(1);
  auto out = at::empty({tokens, hidden}, y.options());
  if (out.numel() == 0) return out;
  TP_EXT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "moe_unpermute", [&] {
    const scalar_t* yp = y.const_data_ptr<scalar_t>();
    const int64_t* rp = row_map.const_data_ptr<int64_t>();
    const Acc<scalar_t>* wp = weights.defined() ? weights.const_data_ptr<Acc<scalar_t>>() : nullptr;
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain(hidden * k), [&](int64_t begin, int64_t end) {
      std::vector<Acc<scalar_t>> acc(hidden);
      for (int64_t t = begin; t < end; ++t) {
        zero_acc<scalar_t>(acc.data(), hidden);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = rp[t * k + j];
          if (r >= 0) axpy<scalar_t>(acc.data(), yp + r * hidden, wp ? wp[t * k + j] : 1, hidden);
        }
        store_acc<scalar_t>(o + t * hidden, acc.data(), hidden);
      }
    });
  });
  return out;
}

at::Tensor moe_weight_grad_cpu(const at::Tensor& tokens_in, const at::Tensor& rows_in,
                               const at::Tensor& row_map_in) {
  const auto a = weight_grad_args(tokens_in, rows_in, row_map_in);
  const at::Tensor &tokens = a.tokens, &rows = a.rows, &row_map = a.row_map;
  check_sources(row_map, rows.size(0), "moe_weight_grad");
  const int64_t n = tokens.size(0), k = row_map.size(1), hidden = tokens.size(1);
  auto out = at::zeros({n, k}, tokens.options().dtype(weight_grad_dtype(rows)));
  if (out.numel() == 0 || hidden == 0) return out;
  TP_EXT_DISPATCH_FLOATING_TYPES(tokens.scalar_type(), "moe_weight_grad", [&] {
    const scalar_t* a = tokens.const_data_ptr<scalar_t>();
    const scalar_t* b = rows.const_data_ptr<scalar_t>();
    const int64_t* rp = row_map.const_data_ptr<int64_t>();
    Acc<scalar_t>* o = out.data_ptr<Acc<scalar_t>>();
    at::parallel_for(0, n, grain(hidden * k), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = rp[t * k + j];
          if (r >= 0) o[t * k + j] = dot<scalar_t>(a + t * hidden, b + r * hidden, hidden);
        }
    });
  });
  return out;
}

// ---- autograd: permute and unpermute are each other's backward ----

using PermuteSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, int64_t);
using UnpermuteSig = at::Tensor(const at::Tensor&, const at::Tensor&,
                                const c10::optional<at::Tensor>&);
using WeightGradSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

// Autograd Functions take no undefined tensors: "no weights" travels as a 0-d placeholder (real
// weights are [tokens, top_k]).
c10::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() && t.dim() > 0 ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

at::Tensor or_placeholder(const c10::optional<at::Tensor>& w, const at::Tensor& like) {
  return w.has_value() && w->defined() ? *w : at::zeros({}, like.options());
}

at::Tensor call_permute(const at::Tensor& x, const at::Tensor& row_map, const at::Tensor& w,
                        int64_t num_rows) {
  static auto handle = op_handle("moe_permute").typed<PermuteSig>();
  return handle.call(x, row_map, opt(w), num_rows);
}

at::Tensor call_unpermute(const at::Tensor& y, const at::Tensor& row_map, const at::Tensor& w) {
  static auto handle = op_handle("moe_unpermute").typed<UnpermuteSig>();
  return handle.call(y, row_map, opt(w));
}

at::Tensor call_weight_grad(const at::Tensor& tokens, const at::Tensor& rows,
                            const at::Tensor& row_map, const at::Tensor& w) {
  static auto handle = op_handle("moe_weight_grad").typed<WeightGradSig>();
  return handle.call(tokens, rows, row_map).to(w.scalar_type());
}

// weights: a 0-d placeholder when there are none (see opt()); it gets no gradient.
class MoePermuteFn : public torch::autograd::Function<MoePermuteFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& row_map, const at::Tensor& weights,
                            int64_t num_rows) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x, row_map, weights});
    return call_permute(x, row_map, weights, num_rows);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &row_map = saved[1], &w = saved[2];
    at::Tensor grad_x, grad_w;
    if (grads[0].defined()) {
      if (ctx->needs_input_grad(0)) grad_x = call_unpermute(grads[0], row_map, w);
      if (opt(w).has_value() && ctx->needs_input_grad(2))
        grad_w = call_weight_grad(x, grads[0].to(x.scalar_type()), row_map, w);
    }
    return {grad_x, at::Tensor(), grad_w, at::Tensor()};
  }
};

class MoeUnpermuteFn : public torch::autograd::Function<MoeUnpermuteFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y,
                            const at::Tensor& row_map, const at::Tensor& weights) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({y, row_map, weights});
    return call_unpermute(y, row_map, weights);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &y = saved[0], &row_map = saved[1], &w = saved[2];
    at::Tensor grad_y, grad_w;
    if (grads[0].defined()) {
      const auto g = grads[0].to(y.scalar_type());
      if (ctx->needs_input_grad(0)) grad_y = call_permute(g, row_map, w, y.size(0));
      if (opt(w).has_value() && ctx->needs_input_grad(2))
        grad_w = call_weight_grad(g, y, row_map, w);
    }
    return {grad_y, at::Tensor(), grad_w};
  }
};

at::Tensor moe_permute_autograd(const at::Tensor& x, const at::Tensor& row_map,
                                const c10::optional<at::Tensor>& weights, int64_t num_rows) {
  return MoePermuteFn::apply(x, row_map, or_placeholder(weights, x), num_rows);
}

at::Tensor moe_unpermute_autograd(const at::Tensor& y, const at::Tensor& row_map,
                                  const c10::optional<at::Tensor>& weights) {
  return MoeUnpermuteFn::apply(y, row_map, or_placeholder(weights, y));
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("moe_route", &tp_ext::ops::moe_route_cpu);
  m.impl("moe_permute", &tp_ext::ops::moe_permute_cpu);
  m.impl("moe_unpermute", &tp_ext::ops::moe_unpermute_cpu);
  m.impl("moe_weight_grad", &tp_ext::ops::moe_weight_grad_cpu);
}

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("moe_permute", &tp_ext::ops::moe_permute_autograd);
  m.impl("moe_unpermute", &tp_ext::ops::moe_unpermute_autograd);
  m.impl("moe_route", torch::autograd::autogradNotImplementedFallback());
  m.impl("moe_weight_grad", torch::autograd::autogradNotImplementedFallback());
}
