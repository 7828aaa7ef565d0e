// CUDA kernels of swiglu / swiglu_backward (see swiglu.cpp for the math): elementwise over
// [N, I] with a grid-stride loop, fp32 math, on the current stream. Inputs arrive contiguous.
#include "fused.h"

#include <ATen/Dispatch.h>
#include <cuda_runtime.h>

namespace tp_ext::fused {
namespace {

void check_launch() {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "tp_ext: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float round_t(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
__global__ void swiglu_kernel(const T* __restrict__ gu, int64_t inter, int64_t total,
                              T* __restrict__ out) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / inter, j = k - i * inter;
    const float g = static_cast<float>(gu[i * 2 * inter + j]);
    const float u = static_cast<float>(gu[i * 2 * inter + inter + j]);
    out[k] = static_cast<T>(round_t<T>(g / (1.f + __expf(-g))) * u);
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ grad, const T* __restrict__ gu,
                                       int64_t inter, int64_t total, T* __restrict__ out) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = k / inter, j = k - i * inter;
    const float g = static_cast<float>(gu[i * 2 * inter + j]);
    const float u = static_cast<float>(gu[i * 2 * inter + inter + j]);
    const float dy = static_cast<float>(grad[k]);
    const float sig = 1.f / (1.f + __expf(-g));
    out[i * 2 * inter + j] = static_cast<T>(round_t<T>(dy * u) * sig * (1.f + g * (1.f - sig)));
    out[i * 2 * inter + inter + j] = static_cast<T>(dy * round_t<T>(g * sig));
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
  check_launch();
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
  check_launch();
}

}  // namespace tp_ext::fused
