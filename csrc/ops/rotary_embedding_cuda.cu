// CUDA kernel of tp_ext::rotary_embedding (maths, checks and autograd: rotary_embedding.cpp) and
// its registration at the CUDA key. One launch rotates q and k: a grid-stride loop over
// (row, pair) where rows are q's [B, Hq, S] then k's [B, Hk, S] and a pair is (j, j + D/2); fp32
// math (fp64 for fp64). Fast path (D/2 a multiple of 16 bytes of elements, rows aligned): each
// step rotates a 128-bit pack of pairs, and steps run position-major (every head of a position,
// q's then k's, before the next position) so the position's cos/sin are read from memory once.
#include <ATen/OpMathType.h>
// c10's stream header, not ATen/cuda/CUDAContext.h (which pulls in cuSPARSE/cuBLAS headers the
// compile-check toolkit lacks); c10::cuda::getCurrentCUDAStream is what at::cuda re-exports.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../common/cuda_vec.cuh"
#include "../common/dispatch.h"
#include "rotary_embedding.h"

namespace tp_ext::ops {
namespace {

// A [B, H, S, D] tensor with unit stride along D.
template <typename T>
struct View4 {
  T* data;
  int64_t heads, s0, s1, s2;
};

template <typename scalar_t>
__global__ void rotary_kernel(View4<const scalar_t> q, View4<const scalar_t> k, View4<scalar_t> qo,
                              View4<scalar_t> ko, const scalar_t* __restrict__ cos,
                              const scalar_t* __restrict__ sin, int64_t batch, int64_t seq,
                              int64_t half) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t q_rows = batch * q.heads * seq;
  const int64_t total = (q_rows + batch * k.heads * seq) * half;
  const int64_t d = 2 * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % half;
    int64_t r = idx / half;
    const bool is_q = r < q_rows;
    if (!is_q) r -= q_rows;
    const auto& in = is_q ? q : k;
    const auto& out = is_q ? qo : ko;
    const int64_t s = r % seq, bh = r / seq, h = bh % in.heads, b = bh / in.heads;
    const scalar_t* x = in.data + b * in.s0 + h * in.s1 + s * in.s2;
    scalar_t* y = out.data + b * out.s0 + h * out.s1 + s * out.s2;
    const int64_t t = (b * seq + s) * d;  // cos/sin are contiguous [B, S, D]
    const acc_t a = x[j], bb = x[j + half];
    y[j] = static_cast<scalar_t>(a * acc_t(cos[t + j]) - bb * acc_t(sin[t + j]));
    y[j + half] =
        static_cast<scalar_t>(bb * acc_t(cos[t + j + half]) + a * acc_t(sin[t + j + half]));
  }
}

// Step idx -> (pack c of the first half, head h of q's then k's, position s, batch b).
template <typename scalar_t>
__global__ void rotary_vec_kernel(View4<const scalar_t> q, View4<const scalar_t> k,
                                  View4<scalar_t> qo, View4<scalar_t> ko,
                                  const scalar_t* __restrict__ cos,
                                  const scalar_t* __restrict__ sin, int64_t batch, int64_t seq,
                                  int64_t half) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int V = cuda::kVec<scalar_t>;
  const int64_t packs = half / V, heads = q.heads + k.heads;
  const int64_t total = batch * seq * heads * packs;
  const int64_t d = 2 * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = (idx % packs) * V;
    int64_t r = idx / packs;
    const int64_t hh = r % heads;
    r /= heads;
    const int64_t s = r % seq, b = r / seq;
    const bool is_q = hh < q.heads;
    const int64_t h = is_q ? hh : hh - q.heads;
    const auto& in = is_q ? q : k;
    const auto& out = is_q ? qo : ko;
    const scalar_t* x = in.data + b * in.s0 + h * in.s1 + s * in.s2;
    scalar_t* y = out.data + b * out.s0 + h * out.s1 + s * out.s2;
    const int64_t t = (b * seq + s) * d + j;  // cos/sin are contiguous [B, S, D]
    const auto a = cuda::load_pack<scalar_t, V>(x + j);
    const auto bb = cuda::load_pack<scalar_t, V>(x + j + half);
    const auto c1 = cuda::load_pack<scalar_t, V>(cos + t);
    const auto c2 = cuda::load_pack<scalar_t, V>(cos + t + half);
    const auto s1 = cuda::load_pack<scalar_t, V>(sin + t);
    const auto s2 = cuda::load_pack<scalar_t, V>(sin + t + half);
    cuda::Pack<scalar_t, V> y1, y2;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const acc_t av = a.v[e], bv = bb.v[e];
      y1.v[e] = static_cast<scalar_t>(av * acc_t(c1.v[e]) - bv * acc_t(s1.v[e]));
      y2.v[e] = static_cast<scalar_t>(bv * acc_t(c2.v[e]) + av * acc_t(s2.v[e]));
    }
    cuda::store_pack(y + j, y1);
    cuda::store_pack(y + j + half, y2);
  }
}

// Packs of pairs fit: D/2 whole packs, every row start a whole number of packs (the strides of
// dims longer than 1), every pointer 16-byte aligned.
template <typename scalar_t>
bool vectorizable(int64_t half, std::initializer_list<const at::Tensor*> tensors) {
  constexpr int V = cuda::kVec<scalar_t>;
  if (half % V != 0) return false;
  for (const at::Tensor* t : tensors) {
    for (int64_t dim = 0; dim + 1 < t->dim(); ++dim)
      if (t->size(dim) > 1 && t->stride(dim) % V != 0) return false;
    if (!cuda::aligned_to(16, {t->const_data_ptr()})) return false;
  }
  return true;
}

template <typename T, typename U>
View4<T> view_of(U* data, const at::Tensor& t) {
  return {data, t.size(1), t.stride(0), t.stride(1), t.stride(2)};
}

std::tuple<at::Tensor, at::Tensor> rotary_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                               const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_rotary_args(q_in, k_in, cos_in, sin_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const auto k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const auto cos = cos_in.contiguous(), sin = sin_in.contiguous();
  auto q_out = rotary_out_like(q_in), k_out = rotary_out_like(k_in);
  const int64_t batch = q.size(0), seq = q.size(2), half = q.size(3) / 2;
  const int64_t total = batch * (q.size(1) + k.size(1)) * seq * half;
  if (total == 0) return {q_out, k_out};
  constexpr int threads = 256;
  // Enough blocks to fill the GPU; the grid-stride loop covers the rest.
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65535 * 8);
  TP_EXT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "rotary_embedding_cuda", [&] {
    const auto qv = view_of<const scalar_t>(q.const_data_ptr<scalar_t>(), q);
    const auto kv = view_of<const scalar_t>(k.const_data_ptr<scalar_t>(), k);
    const auto qo = view_of<scalar_t>(q_out.data_ptr<scalar_t>(), q_out);
    const auto ko = view_of<scalar_t>(k_out.data_ptr<scalar_t>(), k_out);
    const scalar_t* c = cos.const_data_ptr<scalar_t>();
    const scalar_t* s = sin.const_data_ptr<scalar_t>();
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (vectorizable<scalar_t>(half, {&q, &k, &q_out, &k_out, &cos, &sin})) {
      const int64_t steps = total / cuda::kVec<scalar_t>;
      const int64_t vec_blocks = std::min<int64_t>((steps + threads - 1) / threads, 65535 * 8);
      rotary_vec_kernel<scalar_t>
          <<<vec_blocks, threads, 0, stream>>>(qv, kv, qo, ko, c, s, batch, seq, half);
    } else {
      rotary_kernel<scalar_t>
          <<<blocks, threads, 0, stream>>>(qv, kv, qo, ko, c, s, batch, seq, half);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {q_out, k_out};
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) { m.impl("rotary_embedding", &tp_ext::ops::rotary_cuda); }
