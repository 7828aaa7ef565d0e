// CUDA kernels of swiglu / swiglu_backward (see swiglu.cpp for the math): elementwise over
// [N, I] with a grid-stride loop, fp32 math (double for double), one rounding, on the current
// stream. Inputs arrive contiguous.
#include "fused.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <type_traits>

namespace tp_ext::fused {
namespace {

constexpr int kThreads = 256;

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

int64_t blocks_for(int64_t total) {
  constexpr int64_t cap = 2048;  // enough blocks to fill any current GPU; grid-stride beyond
  return std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, cap));
}

}  // namespace

void swiglu_cuda_launch(const at::Tensor& gate_up, at::Tensor& out, void* stream_ptr) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t inter = out.size(-1), total = out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "swiglu_cuda", [&] {
    swiglu_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(
        gate_up.const_data_ptr<scalar_t>(), inter, total, out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swiglu_backward_cuda_launch(const at::Tensor& grad, const at::Tensor& gate_up,
                                 at::Tensor& grad_gate_up, void* stream_ptr) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t inter = grad.size(-1), total = grad.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "swiglu_backward_cuda", [&] {
    swiglu_backward_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(
        grad.const_data_ptr<scalar_t>(), gate_up.const_data_ptr<scalar_t>(), inter, total,
        grad_gate_up.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace tp_ext::fused
