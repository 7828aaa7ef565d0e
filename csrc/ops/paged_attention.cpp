// Attention over a paged KV cache (the serving engine's: tp_ext/serving/kv_cache.py): the keys
// and values are read from their slots in the cache pools, never gathered into a dense copy.
//
//   q          [R, Hq, S, D]   each row's S new queries (a row with fewer is padded on the left)
//   k_cache    [N, Hkv, D]     the pools (Hq a multiple of Hkv: query head h reads KV head
//   v_cache    [N, Hkv, D]     h / (Hq / Hkv), as grouped-query attention shares them)
//   slots      [R, L] int64    where row r's key column c lives (padding: any valid slot)
//   key_mask   [R, L]          nonzero at the row's real keys
//   past       L - S           the key columns before the first query's own
//
// Query j of row r attends to the columns c <= past + j with key_mask[r, c] set, and always to
// its own column past + j (a padding query then attends to itself alone, so no row is empty):
// softmax(scale q k^T) v over those, in float (double for float64), rounded once.
//
// The CPU kernel walks the slots directly, a (row, KV head, query) per task, each key and value
// read once for the query heads sharing them (fp32 math with Vectorized<float>; fp64 in
// double). CUDA tensors take an ATen composition of the same rule (the keys gathered, then masked
// attention). The engine calls it for decode rows (one query each); prompt chunks, many queries
// over the same keys, are matmuls and go through the gathered keys.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../common/dispatch.h"

namespace tp_ext::ops {

namespace {

struct PagedArgs {
  at::Tensor q, k, v, slots, mask;
  int64_t rows = 0, heads = 0, queries = 0, dim = 0, kv_heads = 0, length = 0, past = 0;
  double scale = 1.0;
};

PagedArgs paged_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slots, const at::Tensor& key_mask, int64_t past) {
  const char* op = "tp_ext.paged_attention";
  TORCH_CHECK_VALUE(q.dim() == 4 && at::isFloatingType(q.scalar_type()), op,
                    ": q must be a floating [rows, heads, queries, head_dim] tensor, got ",
                    q.scalar_type(), " of shape ", q.sizes(), ".");
  TORCH_CHECK_VALUE(k_cache.dim() == 3 && k_cache.sizes().equals(v_cache.sizes()), op,
                    ": k_cache and v_cache must both be [slots, kv_heads, head_dim], got ",
                    k_cache.sizes(), " and ", v_cache.sizes(), ".");
  TORCH_CHECK_VALUE(
      k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), op,
      ": q, k_cache and v_cache must share a dtype, got ", q.scalar_type(), ", ",
      k_cache.scalar_type(), " and ", v_cache.scalar_type(), ".");
  TORCH_CHECK_VALUE(k_cache.size(2) == q.size(3), op, ": head_dim differs: q has ", q.size(3),
                    ", the cache ", k_cache.size(2), ".");
  const int64_t kv_heads = k_cache.size(1);
  TORCH_CHECK_VALUE(kv_heads > 0 && q.size(1) % kv_heads == 0, op, ": q's ", q.size(1),
                    " heads are not a multiple of the cache's ", kv_heads, " KV heads.");
  TORCH_CHECK_VALUE(
      slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.size(0) == q.size(0), op,
      ": slots must be int64 [rows, length] with q's ", q.size(0), " rows, got ",
      slots.scalar_type(), " of shape ", slots.sizes(), ".");
  TORCH_CHECK_VALUE(key_mask.sizes().equals(slots.sizes()), op,
                    ": key_mask must have slots' shape ", slots.sizes(), ", got ", key_mask.sizes(),
                    ".");
  TORCH_CHECK_VALUE(past >= 0 && past + q.size(2) == slots.size(1), op, ": past (", past,
                    ") + queries (", q.size(2), ") must equal the key columns (", slots.size(1),
                    ").");
  const auto devices = {k_cache.device(), v_cache.device(), slots.device(), key_mask.device()};
  for (const auto& d : devices)
    TORCH_CHECK_VALUE(d == q.device(), op, ": every input must be on q's device ", q.device(),
                      ", got one on ", d, ".");
  if (slots.numel() > 0 && k_cache.size(0) > 0) {
    const auto [low, high] = at::aminmax(slots);
    TORCH_CHECK_VALUE(low.item<int64_t>() >= 0 && high.item<int64_t>() < k_cache.size(0), op,
                      ": slots must lie in [0, ", k_cache.size(0), "), got [", low.item<int64_t>(),
                      ", ", high.item<int64_t>(), "].");
  }
  TORCH_CHECK_VALUE(slots.numel() == 0 || k_cache.size(0) > 0, op, ": the cache has no slots.");
  PagedArgs a;
  a.q = q.contiguous();
  a.k = k_cache.contiguous();
  a.v = v_cache.contiguous();
  a.slots = slots.contiguous();
  a.mask = key_mask.to(at::kBool).contiguous();
  a.rows = q.size(0), a.heads = q.size(1), a.queries = q.size(2), a.dim = q.size(3);
  a.kv_heads = kv_heads, a.length = slots.size(1), a.past = past;
  return a;
}

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float buf[kVec];
  acc.store(buf);
  float s = 0.f;
  for (int64_t k = 0; k < kVec; ++k) s += buf[k];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w x
  const Vec wv(w);
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec)
    at::vec::fmadd(wv, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  for (; d < n; ++d) y[d] += w * x[d];
}

inline double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(double w, const double* x, double* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += w * x[d];
}

// acc_t's view of a row: the row itself when its type is acc_t, else converted into `buf`.
template <typename scalar_t, typename acc_t>
inline const acc_t* as_acc(const scalar_t* row, acc_t* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return row;
  } else {
    for (int64_t d = 0; d < n; ++d) buf[d] = static_cast<acc_t>(row[d]);
    return buf;
  }
}

// One task: row r, KV head g, query j, for the `group` query heads sharing g (each key and
// value row is read once for all of them).
template <typename scalar_t>
void paged_cpu_kernel(const PagedArgs& a, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* q = a.q.const_data_ptr<scalar_t>();
  const scalar_t* k = a.k.const_data_ptr<scalar_t>();
  const scalar_t* v = a.v.const_data_ptr<scalar_t>();
  const int64_t* slots = a.slots.const_data_ptr<int64_t>();
  const bool* mask = a.mask.const_data_ptr<bool>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  const int64_t D = a.dim, L = a.length, S = a.queries, G = a.kv_heads;
  const int64_t group = a.heads / a.kv_heads;
  const acc_t scale = static_cast<acc_t>(a.scale);
  const acc_t lowest = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, a.rows * G * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> weights(group * L), acc(group * D), queries(group * D), row(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task % S, g = (task / S) % G, r = task / (S * G);
      const int64_t own = a.past + j;
      for (int64_t i = 0; i < group; ++i) {  // q[r, g * group + i, j]
        const scalar_t* qi = q + ((r * a.heads + g * group + i) * S + j) * D;
        for (int64_t d = 0; d < D; ++d) queries[i * D + d] = static_cast<acc_t>(qi[d]);
      }
      std::vector<acc_t> top(group, lowest);
      for (int64_t c = 0; c <= own; ++c) {
        const bool seen = c == own || mask[r * L + c];
        const acc_t* kc =
            seen ? as_acc(k + (slots[r * L + c] * G + g) * D, row.data(), D) : nullptr;
        for (int64_t i = 0; i < group; ++i) {
          const acc_t w = seen ? dot(queries.data() + i * D, kc, D) * scale : lowest;
          weights[i * L + c] = w;
          top[i] = std::max(top[i], w);
        }
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::vector<acc_t> total(group, acc_t(0));
      for (int64_t c = 0; c <= own; ++c) {
        if (c != own && !mask[r * L + c]) continue;
        const acc_t* vc = as_acc(v + (slots[r * L + c] * G + g) * D, row.data(), D);
        for (int64_t i = 0; i < group; ++i) {
          const acc_t w = std::exp(weights[i * L + c] - top[i]);
          total[i] += w;
          axpy(w, vc, acc.data() + i * D, D);
        }
      }
      for (int64_t i = 0; i < group; ++i) {
        scalar_t* oi = o + ((r * a.heads + g * group + i) * S + j) * D;
        for (int64_t d = 0; d < D; ++d) oi[d] = static_cast<scalar_t>(acc[i * D + d] / total[i]);
      }
    }
  });
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& slots,
                               const at::Tensor& key_mask, int64_t past, double scale) {
  auto a = paged_args(q, k_cache, v_cache, slots, key_mask, past);
  a.scale = scale;
  auto out = at::empty_like(a.q);
  if (out.numel() == 0) return out;
  TP_EXT_DISPATCH_FLOATING_TYPES(a.q.scalar_type(), "paged_attention",
                                 [&] { paged_cpu_kernel<scalar_t>(a, out); });
  return out;
}

// The same rule from ATen ops (any device): gather the keys, mask, softmax in float.
at::Tensor paged_attention_composite(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& slots,
                                     const at::Tensor& key_mask, int64_t past, double scale) {
  auto a = paged_args(q, k_cache, v_cache, slots, key_mask, past);
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t group = a.heads / a.kv_heads;
  // [R, L, Hkv, D] -> [R, Hq, L, D]
  auto keys = a.k.index({a.slots}).permute({0, 2, 1, 3}).repeat_interleave(group, 1).to(acc);
  auto values = a.v.index({a.slots}).permute({0, 2, 1, 3}).repeat_interleave(group, 1).to(acc);
  auto columns = at::arange(a.length, a.slots.options());
  auto own = (at::arange(a.queries, a.slots.options()) + past).unsqueeze(1);  // [S, 1]
  auto allowed = (columns.le(own).unsqueeze(0) & a.mask.unsqueeze(1)) | columns.eq(own);
  auto scores = at::matmul(a.q.to(acc), keys.transpose(-1, -2)) * scale;  // [R, Hq, S, L]
  scores = scores.masked_fill(allowed.unsqueeze(1).logical_not(),
                              -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1), values).to(q.scalar_type());
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) { m.impl("paged_attention", &tp_ext::ops::paged_attention_cpu); }

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("paged_attention", &tp_ext::ops::paged_attention_composite);
}

// Inference only (the serving engine): no derivative.
TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("paged_attention", torch::autograd::autogradNotImplementedFallback());
}
