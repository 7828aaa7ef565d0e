// CUDA kernels of attention_merge / attention_merge_backward (see attention_merge.cpp for the
// math, the shared argument setup and the autograd) and their registration at the CUDA key: one
// warp per row (a query's D features), math in the lse's dtype (fp32 or double), outputs rounded
// once, on the current stream.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "../common/cuda_vec.cuh"
#include "../common/dispatch.h"
#include "attention_merge.h"

namespace tp_ext::ops {
namespace {

using cuda::kThreads;
constexpr int kMergeRowsPerBlock = kThreads / 32;

template <typename A>
__device__ __forceinline__ A merge_lane_sum(A v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// lse = log(e^a + e^b) and the two weights; both -inf (no keys at all) gives weights 0.
template <typename A>
__device__ __forceinline__ void merge_weights_dev(A a, A b, A& lse, A& wa, A& wb) {
  const A hi = a > b ? a : b, lo = a > b ? b : a;
  if (isinf(hi) && hi < 0) {
    lse = hi, wa = 0, wb = 0;
    return;
  }
  lse = hi + log1p(exp(lo - hi));
  wa = exp(a - lse), wb = exp(b - lse);
}

template <typename T, typename A>
__global__ void attention_merge_kernel(const T* __restrict__ oa, const A* __restrict__ la,
                                       const T* __restrict__ ob, const A* __restrict__ lb,
                                       int64_t rows, int64_t d, T* __restrict__ o,
                                       A* __restrict__ l) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kMergeRowsPerBlock) + threadIdx.x / 32;
       r < rows; r += static_cast<int64_t>(gridDim.x) * kMergeRowsPerBlock) {
    A lse, wa, wb;
    merge_weights_dev<A>(la[r], lb[r], lse, wa, wb);
    if (lane == 0) l[r] = lse;
    for (int64_t k = r * d + lane; k < (r + 1) * d; k += 32)
      o[k] = static_cast<T>(wa * static_cast<A>(oa[k]) + wb * static_cast<A>(ob[k]));
  }
}

template <typename T, typename A>
__global__ void attention_merge_backward_kernel(const T* __restrict__ go, const A* __restrict__ gl,
                                                const T* __restrict__ oa, const A* __restrict__ la,
                                                const T* __restrict__ ob, const A* __restrict__ lb,
                                                const T* __restrict__ o, int64_t rows, int64_t d,
                                                T* __restrict__ goa, A* __restrict__ gla,
                                                T* __restrict__ gob, A* __restrict__ glb) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kMergeRowsPerBlock) + threadIdx.x / 32;
       r < rows; r += static_cast<int64_t>(gridDim.x) * kMergeRowsPerBlock) {
    A lse, wa, wb;
    merge_weights_dev<A>(la[r], lb[r], lse, wa, wb);
    A sa = 0, sb = 0;
    for (int64_t k = r * d + lane; k < (r + 1) * d; k += 32) {
      const A g = static_cast<A>(go[k]), m = static_cast<A>(o[k]);
      sa += g * (static_cast<A>(oa[k]) - m);
      sb += g * (static_cast<A>(ob[k]) - m);
      goa[k] = static_cast<T>(wa * g);
      gob[k] = static_cast<T>(wb * g);
    }
    sa = merge_lane_sum(sa);
    sb = merge_lane_sum(sb);
    if (lane == 0) {
      gla[r] = wa * (sa + gl[r]);
      glb[r] = wb * (sb + gl[r]);
    }
  }
}

int64_t merge_blocks_for(int64_t rows) {
  constexpr int64_t cap = 4096;  // grid-stride beyond
  return std::max<int64_t>(
      1, std::min<int64_t>((rows + kMergeRowsPerBlock - 1) / kMergeRowsPerBlock, cap));
}

std::tuple<at::Tensor, at::Tensor> attention_merge_cuda(const at::Tensor& out_a,
                                                        const at::Tensor& lse_a,
                                                        const at::Tensor& out_b,
                                                        const at::Tensor& lse_b) {
  const c10::cuda::CUDAGuard guard(out_a.device());
  auto a = attention_merge_args(out_a, lse_a, out_b, lse_b, "attention_merge");
  const int64_t n = a.lse.numel(), d = a.out.size(1);
  if (n > 0) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(a.lse.scalar_type(), "attention_merge_cuda", [&] {
      using A = scalar_t;
      TP_EXT_DISPATCH_FLOATING_TYPES(a.out.scalar_type(), "attention_merge_cuda", [&] {
        attention_merge_kernel<scalar_t, A><<<merge_blocks_for(n), kThreads, 0, stream>>>(
            a.out_a.const_data_ptr<scalar_t>(), a.lse_a.const_data_ptr<A>(),
            a.out_b.const_data_ptr<scalar_t>(), a.lse_b.const_data_ptr<A>(), n, d,
            a.out.data_ptr<scalar_t>(), a.lse.data_ptr<A>());
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return attention_merge_results(a);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_merge_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& out_a,
    const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b,
    const at::Tensor& out, const at::Tensor& lse) {
  const c10::cuda::CUDAGuard guard(out_a.device());
  auto b = attention_merge_backward_args(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse);
  const auto& m = b.merge;
  const int64_t n = m.lse.numel(), d = m.out.size(1);
  if (n > 0) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(m.lse.scalar_type(), "attention_merge_backward_cuda", [&] {
      using A = scalar_t;
      TP_EXT_DISPATCH_FLOATING_TYPES(m.out.scalar_type(), "attention_merge_backward_cuda", [&] {
        attention_merge_backward_kernel<scalar_t, A><<<merge_blocks_for(n), kThreads, 0, stream>>>(
            b.grad_out.const_data_ptr<scalar_t>(), b.grad_lse.const_data_ptr<A>(),
            m.out_a.const_data_ptr<scalar_t>(), m.lse_a.const_data_ptr<A>(),
            m.out_b.const_data_ptr<scalar_t>(), m.lse_b.const_data_ptr<A>(),
            m.out.const_data_ptr<scalar_t>(), n, d, b.grad_out_a.data_ptr<scalar_t>(),
            b.grad_lse_a.data_ptr<A>(), b.grad_out_b.data_ptr<scalar_t>(),
            b.grad_lse_b.data_ptr<A>());
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return attention_merge_backward_results(b);
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("attention_merge", &tp_ext::ops::attention_merge_cuda);
  m.impl("attention_merge_backward", &tp_ext::ops::attention_merge_backward_cuda);
}
