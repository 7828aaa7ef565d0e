// CUDA kernels of quantize_int8_ef / dequantize_int8 / quantize_1bit_ef / dequantize_1bit (the
// math, the layout's CPU reference and the shared argument setup: grad_compression.cpp and .h) and
// their registration at the CUDA key. Quantisers: one block per chunk (grid-stride over chunks),
// v = grad + residual written to residual, a block reduction of max|v| or sum|v| through warp
// shuffles, then a second pass over the same elements; 1-bit signs packed by __ballot_sync.
// Dequantisers: elementwise grid-stride loops. All on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
// c10's stream header, not ATen/cuda/CUDAContext.h (which pulls in cuSPARSE/cuBLAS headers the
// compile-check toolkit lacks); c10::cuda::getCurrentCUDAStream is what at::cuda re-exports.
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../common/cuda_vec.cuh"
#include "../common/dispatch.h"
#include "grad_compression.h"

namespace tp_ext::ops {
namespace {

using cuda::kThreads;
using cuda::threads_for;
constexpr int64_t kMaxBlocks = 4096;  // enough to fill any current GPU; grid-stride beyond

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// Reduction over the block; every thread gets the result. Safe to call again in a loop: the
// trailing barrier orders this call's reads of `total` before the next call's writes.
template <typename Op>
__device__ float block_reduce(float v, Op op) {
  __shared__ float partial[kThreads / 32];
  __shared__ float total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (blockDim.x + 31) / 32 ? partial[lane] : 0.f;  // 0 is neutral for max|v| and sum
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// v = grad + residual over this thread's elements of [begin, end), written to residual; returns
// the block's max|v| (kOneBit false) or sum|v| (true). The second pass of each quantiser reads
// back only the elements this thread wrote here (same stride), so it needs no barrier.
template <typename T, bool kOneBit>
__device__ float add_residual(const T* __restrict__ grad, float* __restrict__ residual,
                              int64_t begin, int64_t end) {
  float acc = 0.f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = static_cast<float>(grad[i]) + residual[i];
    residual[i] = v;
    acc = kOneBit ? acc + fabsf(v) : fmaxf(acc, fabsf(v));
  }
  return kOneBit ? block_reduce(acc, Sum()) : block_reduce(acc, Max());
}

template <typename T>
__global__ void quantize_int8_kernel(const T* __restrict__ grad, float* __restrict__ residual,
                                     int8_t* __restrict__ codes, float* __restrict__ scales,
                                     int64_t n, int64_t chunk, int64_t chunks) {
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {  // uniform per block: barriers ok
    const int64_t begin = c * chunk, end = min(n, begin + chunk);
    const float scale = add_residual<T, false>(grad, residual, begin, end) / 127.f;
    if (threadIdx.x == 0) scales[c] = scale;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float v = residual[i];
      const float q = scale > 0.f ? nearbyintf(v / scale) : 0.f;
      codes[i] = static_cast<int8_t>(fminf(fmaxf(q, -127.f), 127.f));
      residual[i] = __fsub_rn(v, __fmul_rn(q, scale));  // no FMA contraction: as the CPU rounds
    }
  }
}

template <typename T>
__global__ void quantize_1bit_kernel(const T* __restrict__ grad, float* __restrict__ residual,
                                     uint8_t* __restrict__ bits, float* __restrict__ scales,
                                     int64_t n, int64_t chunk, int64_t chunks) {
  const int lane = threadIdx.x % 32;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t begin = c * chunk, end = min(n, begin + chunk);
    const float scale =
        add_residual<T, true>(grad, residual, begin, end) / static_cast<float>(end - begin);
    if (threadIdx.x == 0) scales[c] = scale;
    // Whole warps iterate together (the loop bound is per block) so __ballot_sync sees all lanes.
    // begin and blockDim are multiples of 8, so each warp's 32 elements are 4 whole bytes.
    for (int64_t base = begin; base < end; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      const bool in = i < end;
      const float v = in ? residual[i] : 0.f;
      const bool positive = in && v >= 0.f;
      const unsigned ballot = __ballot_sync(0xffffffffu, positive);
      if (in) {
        residual[i] = v - (positive ? scale : -scale);
        // Byte i / 8 lies wholly in this chunk (it starts before end, and chunks end on bytes or
        // at n): one writer per byte, no atomics. Lanes past end contribute 0 bits.
        if (lane % 8 == 0) bits[i / 8] = static_cast<uint8_t>(ballot >> lane);
      }
    }
  }
}

__global__ void dequantize_int8_kernel(const int8_t* __restrict__ codes,
                                       const float* __restrict__ scales, int64_t n, int64_t chunk,
                                       float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = static_cast<float>(codes[i]) * scales[i / chunk];
}

__global__ void dequantize_1bit_kernel(const uint8_t* __restrict__ bits,
                                       const float* __restrict__ scales, int64_t n, int64_t chunk,
                                       float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float scale = scales[i / chunk];
    out[i] = (bits[i / 8] >> (i % 8)) & 1 ? scale : -scale;
  }
}

int64_t elementwise_blocks(int64_t n) {
  return std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks);
}

// The setup runs first (identical errors on both devices, outputs allocated on grad's device);
// the guard then makes that device current for the launch.
std::tuple<at::Tensor, at::Tensor> quantize_int8_ef_cuda(const at::Tensor& grad,
                                                         const at::Tensor& residual,
                                                         int64_t chunk_size) {
  auto a = quantize_args(grad, residual, chunk_size, false, "quantize_int8_ef");
  const int64_t n = a.grad.numel(), chunks = a.scales.numel();
  if (n == 0) return {a.codes, a.scales};
  const c10::cuda::CUDAGuard guard(a.grad.device());
  TP_EXT_DISPATCH_FLOATING_TYPES(a.grad.scalar_type(), "quantize_int8_ef_cuda", [&] {
    quantize_int8_kernel<scalar_t><<<std::min(chunks, kMaxBlocks), threads_for(chunk_size), 0,
                                     c10::cuda::getCurrentCUDAStream()>>>(
        a.grad.const_data_ptr<scalar_t>(), a.residual.mutable_data_ptr<float>(),
        a.codes.mutable_data_ptr<int8_t>(), a.scales.mutable_data_ptr<float>(), n, chunk_size,
        chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {a.codes, a.scales};
}

std::tuple<at::Tensor, at::Tensor> quantize_1bit_ef_cuda(const at::Tensor& grad,
                                                         const at::Tensor& residual,
                                                         int64_t chunk_size) {
  auto a = quantize_args(grad, residual, chunk_size, true, "quantize_1bit_ef");
  const int64_t n = a.grad.numel(), chunks = a.scales.numel();
  if (n == 0) return {a.codes, a.scales};
  const c10::cuda::CUDAGuard guard(a.grad.device());
  TP_EXT_DISPATCH_FLOATING_TYPES(a.grad.scalar_type(), "quantize_1bit_ef_cuda", [&] {
    quantize_1bit_kernel<scalar_t><<<std::min(chunks, kMaxBlocks), threads_for(chunk_size), 0,
                                     c10::cuda::getCurrentCUDAStream()>>>(
        a.grad.const_data_ptr<scalar_t>(), a.residual.mutable_data_ptr<float>(),
        a.codes.mutable_data_ptr<uint8_t>(), a.scales.mutable_data_ptr<float>(), n, chunk_size,
        chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {a.codes, a.scales};
}

at::Tensor dequantize_int8_cuda(const at::Tensor& codes, const at::Tensor& scales,
                                int64_t chunk_size) {
  auto a = dequantize_args(codes, scales, chunk_size, codes.defined() ? codes.numel() : 0, false,
                           "dequantize_int8");
  const int64_t n = a.out.numel();
  if (n == 0) return a.out;
  const c10::cuda::CUDAGuard guard(a.out.device());
  dequantize_int8_kernel<<<elementwise_blocks(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      a.codes.const_data_ptr<int8_t>(), a.scales.const_data_ptr<float>(), n, chunk_size,
      a.out.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return a.out;
}

at::Tensor dequantize_1bit_cuda(const at::Tensor& bits, const at::Tensor& scales,
                                int64_t chunk_size, int64_t numel) {
  auto a = dequantize_args(bits, scales, chunk_size, numel, true, "dequantize_1bit");
  if (numel == 0) return a.out;
  const c10::cuda::CUDAGuard guard(a.out.device());
  dequantize_1bit_kernel<<<elementwise_blocks(numel), kThreads, 0,
                           c10::cuda::getCurrentCUDAStream()>>>(
      a.codes.const_data_ptr<uint8_t>(), a.scales.const_data_ptr<float>(), numel, chunk_size,
      a.out.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return a.out;
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("quantize_int8_ef", &tp_ext::ops::quantize_int8_ef_cuda);
  m.impl("dequantize_int8", &tp_ext::ops::dequantize_int8_cuda);
  m.impl("quantize_1bit_ef", &tp_ext::ops::quantize_1bit_ef_cuda);
  m.impl("dequantize_1bit", &tp_ext::ops::dequantize_1bit_cuda);
}
