// CUDA kernels of swiglu / swiglu_backward (see swiglu.cpp for the math, the shared argument
// setup and the autograd) and their registration at the CUDA key: elementwise over [N, I] with a
// grid-stride loop, fp32 math (double for double), one rounding, on the current stream. Inputs
// arrive contiguous. When I is a multiple of 16 bytes of elements (and the tensors are aligned)
// each step moves one 128-bit pack of gate, up and the output; otherwise one element.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
// c10's stream header, not ATen/cuda/CUDAContext.h (which pulls in cuSPARSE/cuBLAS headers the
// compile-check toolkit lacks); c10::cuda::getCurrentCUDAStream is what at::cuda re-exports.
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <type_traits>

#include "../common/cuda_vec.cuh"
#include "../common/dispatch.h"
#include "swiglu.h"

namespace tp_ext::ops {
namespace {

using cuda::kThreads;

// fp32 math for every type but double, which keeps double.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
__global__ void swiglu_kernel(const T* __restrict__ gu, int64_t inter, int64_t total,
                              T* __restrict__ out) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / inter, j = k - i * inter;
    const Acc<T> g = static_cast<Acc<T>>(gu[i * 2 * inter + j]);
    const Acc<T> u = static_cast<Acc<T>>(gu[i * 2 * inter + inter + j]);
    out[k] = static_cast<T>(g / (1 + exp(-g)) * u);
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ grad, const T* __restrict__ gu,
                                       int64_t inter, int64_t total, T* __restrict__ out) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / inter, j = k - i * inter;
    const Acc<T> g = static_cast<Acc<T>>(gu[i * 2 * inter + j]);
    const Acc<T> u = static_cast<Acc<T>>(gu[i * 2 * inter + inter + j]);
    const Acc<T> dy = static_cast<Acc<T>>(grad[k]);
    const Acc<T> sig = 1 / (1 + exp(-g));
    out[i * 2 * inter + j] = static_cast<T>(dy * u * sig * (1 + g * (1 - sig)));
    out[i * 2 * inter + inter + j] = static_cast<T>(dy * g * sig);
  }
}

// The same math on packs of V elements: k indexes packs of the [N, I] output.
template <typename T>
__global__ void swiglu_vec_kernel(const T* __restrict__ gu, int64_t inter, int64_t packs,
                                  T* __restrict__ out) {
  constexpr int V = cuda::kVec<T>;
  const int64_t per_row = inter / V;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < packs;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / per_row, j = (k - i * per_row) * V;
    const auto g = cuda::load_pack<T, V>(gu + i * 2 * inter + j);
    const auto u = cuda::load_pack<T, V>(gu + i * 2 * inter + inter + j);
    cuda::Pack<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const Acc<T> gv = static_cast<Acc<T>>(g.v[e]), uv = static_cast<Acc<T>>(u.v[e]);
      o.v[e] = static_cast<T>(gv / (1 + exp(-gv)) * uv);
    }
    cuda::store_pack(out + i * inter + j, o);
  }
}

template <typename T>
__global__ void swiglu_backward_vec_kernel(const T* __restrict__ grad, const T* __restrict__ gu,
                                           int64_t inter, int64_t packs, T* __restrict__ out) {
  constexpr int V = cuda::kVec<T>;
  const int64_t per_row = inter / V;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < packs;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / per_row, j = (k - i * per_row) * V;
    const auto g = cuda::load_pack<T, V>(gu + i * 2 * inter + j);
    const auto u = cuda::load_pack<T, V>(gu + i * 2 * inter + inter + j);
    const auto dy = cuda::load_pack<T, V>(grad + i * inter + j);
    cuda::Pack<T, V> dg, du;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const Acc<T> gv = static_cast<Acc<T>>(g.v[e]), uv = static_cast<Acc<T>>(u.v[e]);
      const Acc<T> d = static_cast<Acc<T>>(dy.v[e]);
      const Acc<T> sig = 1 / (1 + exp(-gv));
      dg.v[e] = static_cast<T>(d * uv * sig * (1 + gv * (1 - sig)));
      du.v[e] = static_cast<T>(d * gv * sig);
    }
    cuda::store_pack(out + i * 2 * inter + j, dg);
    cuda::store_pack(out + i * 2 * inter + inter + j, du);
  }
}

// Whole packs per row and every tensor 16-byte aligned.
template <typename T>
bool vectorizable(int64_t inter, std::initializer_list<const void*> ptrs) {
  return inter % cuda::kVec<T> == 0 && cuda::aligned_to(16, ptrs);
}

int64_t blocks_for(int64_t total) {
  constexpr int64_t cap = 2048;  // enough blocks to fill any current GPU; grid-stride beyond
  return std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, cap));
}

void swiglu_cuda_launch(const at::Tensor& gate_up, at::Tensor& out, cudaStream_t stream) {
  const int64_t inter = out.size(-1), total = out.numel();
  TP_EXT_DISPATCH_FLOATING_TYPES(gate_up.scalar_type(), "swiglu_cuda", [&] {
    const scalar_t* gu = gate_up.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    if (vectorizable<scalar_t>(inter, {gu, o})) {
      const int64_t packs = total / cuda::kVec<scalar_t>;
      swiglu_vec_kernel<scalar_t><<<blocks_for(packs), kThreads, 0, stream>>>(gu, inter, packs, o);
    } else {
      swiglu_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(gu, inter, total, o);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swiglu_backward_cuda_launch(const at::Tensor& grad, const at::Tensor& gate_up,
                                 at::Tensor& grad_gate_up, cudaStream_t stream) {
  const int64_t inter = grad.size(-1), total = grad.numel();
  TP_EXT_DISPATCH_FLOATING_TYPES(gate_up.scalar_type(), "swiglu_backward_cuda", [&] {
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    const scalar_t* gu = gate_up.const_data_ptr<scalar_t>();
    scalar_t* o = grad_gate_up.data_ptr<scalar_t>();
    if (vectorizable<scalar_t>(inter, {g, gu, o})) {
      const int64_t packs = total / cuda::kVec<scalar_t>;
      swiglu_backward_vec_kernel<scalar_t>
          <<<blocks_for(packs), kThreads, 0, stream>>>(g, gu, inter, packs, o);
    } else {
      swiglu_backward_kernel<scalar_t>
          <<<blocks_for(total), kThreads, 0, stream>>>(g, gu, inter, total, o);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor swiglu_cuda(const at::Tensor& gate_up_in) {
  check_gate_up(gate_up_in, "swiglu");
  const auto gu = gate_up_in.contiguous();
  auto out = at::empty(swiglu_out_shape(gu), gu.options());
  if (out.numel() > 0) swiglu_cuda_launch(gu, out, c10::cuda::getCurrentCUDAStream());
  return out;
}

at::Tensor swiglu_backward_cuda(const at::Tensor& grad_in, const at::Tensor& gate_up_in) {
  auto a = swiglu_backward_args(grad_in, gate_up_in);
  if (a.grad.numel() > 0)
    swiglu_backward_cuda_launch(a.grad, a.gate_up, a.out, c10::cuda::getCurrentCUDAStream());
  return a.out;
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("swiglu", &tp_ext::ops::swiglu_cuda);
  m.impl("swiglu_backward", &tp_ext::ops::swiglu_backward_cuda);
}
