// CUDA kernels of rms_norm / add_rms_norm / rms_norm_backward (see rms_norm.cpp for the math, the
// shared argument setup and the autograd) and their registration at the CUDA key. One block per
// row, fp32 accumulation, block reduction through warp shuffles; launched on the current stream.
// Inputs arrive contiguous; the weight arrives as fp32.
#include <c10/cuda/CUDAException.h>
// c10's stream header, not ATen/cuda/CUDAContext.h (which pulls in cuSPARSE/cuBLAS headers the
// compile-check toolkit lacks); c10::cuda::getCurrentCUDAStream is what at::cuda re-exports.
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "../common/dispatch.h"
#include "rms_norm.h"

namespace tp_ext::ops {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the block; every thread gets the result.
__device__ float block_sum(float v) {
  __shared__ float partial[kThreads / 32];
  __shared__ float total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < (blockDim.x + 31) / 32 ? partial[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// Rounds through T, as the reference's `.to(x.dtype)`.
template <typename T>
__device__ __forceinline__ float round_t(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T, typename O, bool kResidual>
__global__ void rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                const float* __restrict__ w, float eps, int64_t hdim,
                                O* __restrict__ out, T* __restrict__ h) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * hdim;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < hdim; j += blockDim.x) {
    float v = static_cast<float>(xr[j]);
    if constexpr (kResidual) {
      v = round_t<T>(v + static_cast<float>(res[row * hdim + j]));
      h[row * hdim + j] = static_cast<T>(v);
    }
    ss += v * v;
  }
  const float rstd = rsqrtf(block_sum(ss) / static_cast<float>(hdim) + eps);
  // Second pass re-reads x (or h, which this thread wrote itself): rows stay in L1/L2.
  for (int64_t j = threadIdx.x; j < hdim; j += blockDim.x) {
    const float v = kResidual ? static_cast<float>(h[row * hdim + j]) : static_cast<float>(xr[j]);
    out[row * hdim + j] = static_cast<O>(w[j] * round_t<T>(v * rstd));
  }
}

// dx per row, and rstd per row for the weight-gradient kernel.
template <typename T>
__global__ void rms_norm_backward_kernel(const float* __restrict__ g, const T* __restrict__ x,
                                         const float* __restrict__ w, float eps, int64_t hdim,
                                         T* __restrict__ gx, float* __restrict__ rstd_out) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * hdim;
  const float* gr = g + row * hdim;
  float ss = 0.f, dot = 0.f;
  for (int64_t j = threadIdx.x; j < hdim; j += blockDim.x) {
    const float v = static_cast<float>(xr[j]);
    ss += v * v;
    dot += gr[j] * w[j] * v;
  }
  const float rstd = rsqrtf(block_sum(ss) / static_cast<float>(hdim) + eps);
  dot = block_sum(dot);
  const float c3 = rstd * rstd * rstd * dot / static_cast<float>(hdim);
  for (int64_t j = threadIdx.x; j < hdim; j += blockDim.x)
    gx[row * hdim + j] = static_cast<T>(gr[j] * w[j] * rstd - static_cast<float>(xr[j]) * c3);
  if (threadIdx.x == 0) rstd_out[row] = rstd;
}

// Weight gradient: one thread per column, summing over rows (coalesced along each row).
template <typename T>
__global__ void rms_norm_weight_grad_kernel(const float* __restrict__ g, const T* __restrict__ x,
                                            const float* __restrict__ rstd, int64_t n, int64_t hdim,
                                            float* __restrict__ gw) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= hdim) return;
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i)
    acc += g[i * hdim + j] * round_t<T>(static_cast<float>(x[i * hdim + j]) * rstd[i]);
  gw[j] = acc;
}

int threads_for(int64_t hdim) {
  int t = 32;
  while (t < kThreads && t < hdim) t *= 2;
  return t;
}

// x, grad: contiguous [N, H]; w: contiguous fp32 [H]; out in the promoted dtype.
void rms_norm_cuda_launch(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                          double eps, at::Tensor& out, at::Tensor& h, cudaStream_t stream) {
  const int64_t hdim = x.size(-1), n = x.numel() / hdim;
  const bool with_res = residual.defined();
  TP_EXT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_cuda", [&] {
    auto launch = [&](auto* out_ptr) {
      using O = std::remove_pointer_t<decltype(out_ptr)>;
      if (with_res)
        rms_norm_kernel<scalar_t, O, true><<<n, threads_for(hdim), 0, stream>>>(
            x.const_data_ptr<scalar_t>(), residual.const_data_ptr<scalar_t>(),
            w.const_data_ptr<float>(), static_cast<float>(eps), hdim, out_ptr,
            h.data_ptr<scalar_t>());
      else
        rms_norm_kernel<scalar_t, O, false><<<n, threads_for(hdim), 0, stream>>>(
            x.const_data_ptr<scalar_t>(), nullptr, w.const_data_ptr<float>(),
            static_cast<float>(eps), hdim, out_ptr, nullptr);
    };
    if (out.scalar_type() == x.scalar_type())
      launch(out.data_ptr<scalar_t>());
    else if (out.scalar_type() == at::kFloat)
      launch(out.data_ptr<float>());
    else
      launch(out.data_ptr<double>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rms_norm_backward_cuda_launch(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w,
                                   double eps, at::Tensor& grad_x, at::Tensor& grad_w_f32,
                                   cudaStream_t stream) {
  const int64_t hdim = x.size(-1), n = x.numel() / hdim;
  auto rstd = at::empty({n}, x.options().dtype(at::kFloat));
  TP_EXT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_backward_cuda", [&] {
    rms_norm_backward_kernel<scalar_t><<<n, threads_for(hdim), 0, stream>>>(
        grad.const_data_ptr<float>(), x.const_data_ptr<scalar_t>(), w.const_data_ptr<float>(),
        static_cast<float>(eps), hdim, grad_x.data_ptr<scalar_t>(), rstd.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t blocks = (hdim + kThreads - 1) / kThreads;
    rms_norm_weight_grad_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        grad.const_data_ptr<float>(), x.const_data_ptr<scalar_t>(), rstd.const_data_ptr<float>(), n,
        hdim, grad_w_f32.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& x_in, const at::Tensor* res_in,
                                                const at::Tensor& weight, double eps,
                                                const char* op) {
  auto a = rms_norm_args(x_in, res_in, weight, op);
  if (a.x.numel() > 0)
    rms_norm_cuda_launch(a.x, a.res, a.w, eps, a.out, a.h, c10::cuda::getCurrentCUDAStream());
  return {a.out, a.h};
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(forward_cuda(x, nullptr, weight, eps, "rms_norm"));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x,
                                                     const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  check_rms_args(x, weight, "add_rms_norm");
  check_residual(x, residual);
  return forward_cuda(x, &residual, weight, eps, "add_rms_norm");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_in,
                                                          const at::Tensor& x_in,
                                                          const at::Tensor& weight, double eps) {
  const auto in = rms_norm_backward_args(grad_in, x_in, weight);
  const at::Tensor &x = in.x, &g = in.grad, &w = in.weight;
  auto grad_x = at::empty(x.sizes(), x.options());
  auto grad_w = at::zeros({x.size(-1)}, x.options().dtype(at::kFloat));
  if (x.numel() > 0)
    rms_norm_backward_cuda_launch(g, x, w, eps, grad_x, grad_w, c10::cuda::getCurrentCUDAStream());
  return {grad_x, grad_w.to(weight.scalar_type())};
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("rms_norm", &tp_ext::ops::rms_norm_cuda);
  m.impl("add_rms_norm", &tp_ext::ops::add_rms_norm_cuda);
  m.impl("rms_norm_backward", &tp_ext::ops::rms_norm_backward_cuda);
}
