// CUDA kernels of the mixture-of-experts token permutation (see moe_permute.cpp for the math, the
// shared argument setup and the autograd) and their registration at the CUDA key. One block per
// token (per (token, choice) for the weight gradient), threads across the hidden dimension, fp32
// math (double for double), one rounding, on the current stream. moe_route is a stable sort of
// the expert ids (dropped choices last), the same order as the CPU counting sort. Unlike the CPU
// kernel, moe_permute does not check that no row is named twice (that would cost a
// synchronisation); moe_route's row_map never does.
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <type_traits>

#include "../common/cuda_vec.cuh"
#include "../common/dispatch.h"
#include "moe_permute.h"

namespace tp_ext::ops {
namespace {

using cuda::kThreads;

template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
__global__ void permute_kernel(const T* __restrict__ x, const int64_t* __restrict__ row_map,
                               const Acc<T>* __restrict__ w, int64_t k, int64_t hidden,
                               int64_t num_rows, T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = row_map[t * k + j];
    CUDA_KERNEL_ASSERT(r >= -1 && r < num_rows);  // a row_map not from moe_route
    if (r < 0) continue;
    const Acc<T> scale = w ? w[t * k + j] : Acc<T>(1);
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x)
      out[r * hidden + h] =
          w ? static_cast<T>(scale * static_cast<Acc<T>>(x[t * hidden + h])) : x[t * hidden + h];
  }
}

template <typename T>
__global__ void unpermute_kernel(const T* __restrict__ y, const int64_t* __restrict__ row_map,
                                 const Acc<T>* __restrict__ w, int64_t k, int64_t hidden,
                                 int64_t num_rows, T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    Acc<T> acc = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = row_map[t * k + j];
      CUDA_KERNEL_ASSERT(r >= -1 && r < num_rows);
      if (r >= 0) acc += (w ? w[t * k + j] : Acc<T>(1)) * static_cast<Acc<T>>(y[r * hidden + h]);
    }
    out[t * hidden + h] = static_cast<T>(acc);
  }
}

// One block per (token, choice): a block-wide dot product (warp shuffles, then one warp).
template <typename T>
__global__ void weight_grad_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                   const int64_t* __restrict__ row_map, int64_t k, int64_t hidden,
                                   int64_t num_rows, Acc<T>* __restrict__ out) {
  const int64_t slot = blockIdx.x, t = slot / k;
  const int64_t r = row_map[slot];
  CUDA_KERNEL_ASSERT(r >= -1 && r < num_rows);
  Acc<T> s = 0;
  if (r >= 0)
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x)
      s += static_cast<Acc<T>>(a[t * hidden + h]) * static_cast<Acc<T>>(b[r * hidden + h]);
  for (int offset = 16; offset > 0; offset /= 2) s += __shfl_down_sync(0xffffffffu, s, offset);
  __shared__ Acc<T> warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : Acc<T>(0);
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_down_sync(0xffffffffu, s, offset);
    if (threadIdx.x == 0) out[slot] = s;
  }
}

std::tuple<at::Tensor, at::Tensor> moe_route_cuda(const at::Tensor& expert_ids_in,
                                                  int64_t num_experts) {
  const char* op = "moe_route";
  const c10::cuda::CUDAGuard guard(expert_ids_in.device());
  const auto ids = checked_expert_ids(expert_ids_in, num_experts, op);
  const bool bad = ((ids < -1) | (ids >= num_experts)).any().item<bool>();
  TORCH_CHECK_VALUE(!bad, "tp_ext.", op, ": expert_ids holds values outside -1 .. ",
                    num_experts - 1, "; use experts 0 .. ", num_experts - 1,
                    ", or -1 for a dropped token.");
  const auto key = at::where(ids < 0, at::full({}, num_experts, ids.options()), ids).flatten();
  // stable as an optional<bool>: a plain bool would pick sort(self, dim, descending)
  const auto order =
      std::get<1>(at::sort(key, std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  auto flat = at::empty_like(key);
  flat.index_put_({order}, at::arange(key.numel(), key.options()));
  auto row_map =
      at::where(key == num_experts, at::full({}, -1, key.options()), flat).view(ids.sizes());
  auto counts = at::bincount(key, {}, num_experts + 1).narrow(0, 0, num_experts).contiguous();
  return {row_map, counts};
}

at::Tensor moe_permute_cuda(const at::Tensor& x_in, const at::Tensor& row_map_in,
                            const c10::optional<at::Tensor>& weights_in, int64_t num_rows) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto a = permute_args(x_in, row_map_in, weights_in, num_rows);
  const at::Tensor &x = a.x, &row_map = a.row_map, &weights = a.weights;
  auto out = at::zeros({num_rows, x.size(1)}, x.options());
  if (x.size(0) == 0 || row_map.size(1) == 0 || x.size(1) == 0 || num_rows == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  TP_EXT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "moe_permute_cuda", [&] {
    permute_kernel<scalar_t><<<x.size(0), kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), row_map.const_data_ptr<int64_t>(),
        weights.defined() ? weights.const_data_ptr<Acc<scalar_t>>() : nullptr, row_map.size(1),
        x.size(1), num_rows, out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor moe_unpermute_cuda(const at::Tensor& y_in, const at::Tensor& row_map_in,
                              const c10::optional<at::Tensor>& weights_in) {
  const c10::cuda::CUDAGuard guard(y_in.device());
  const auto a = unpermute_args(y_in, row_map_in, weights_in);
  const at::Tensor &y = a.y, &row_map = a.row_map, &weights = a.weights;
  auto out = at::empty({row_map.size(0), y.size(1)}, y.options());
  if (out.numel() == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  TP_EXT_DISPATCH_FLOATING_TYPES(y.scalar_type(), "moe_unpermute_cuda", [&] {
    unpermute_kernel<scalar_t><<<row_map.size(0), kThreads, 0, stream>>>(
        y.const_data_ptr<scalar_t>(), row_map.const_data_ptr<int64_t>(),
        weights.defined() ? weights.const_data_ptr<Acc<scalar_t>>() : nullptr, row_map.size(1),
        y.size(1), y.size(0), out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor moe_weight_grad_cuda(const at::Tensor& tokens_in, const at::Tensor& rows_in,
                                const at::Tensor& row_map_in) {
  const c10::cuda::CUDAGuard guard(tokens_in.device());
  const auto a = weight_grad_args(tokens_in, rows_in, row_map_in);
  const at::Tensor &tokens = a.tokens, &rows = a.rows, &row_map = a.row_map;
  auto out =
      at::zeros({tokens.size(0), row_map.size(1)}, tokens.options().dtype(weight_grad_dtype(rows)));
  if (out.numel() == 0 || tokens.size(1) == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  TP_EXT_DISPATCH_FLOATING_TYPES(tokens.scalar_type(), "moe_weight_grad_cuda", [&] {
    weight_grad_kernel<scalar_t><<<out.numel(), kThreads, 0, stream>>>(
        tokens.const_data_ptr<scalar_t>(), rows.const_data_ptr<scalar_t>(),
        row_map.const_data_ptr<int64_t>(), row_map.size(1), tokens.size(1), rows.size(0),
        out.data_ptr<Acc<scalar_t>>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("moe_route", &tp_ext::ops::moe_route_cuda);
  m.impl("moe_permute", &tp_ext::ops::moe_permute_cuda);
  m.impl("moe_unpermute", &tp_ext::ops::moe_unpermute_cuda);
  m.impl("moe_weight_grad", &tp_ext::ops::moe_weight_grad_cuda);
}
