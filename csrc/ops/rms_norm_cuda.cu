// CUDA kernels of rms_norm / add_rms_norm / rms_norm_backward (see rms_norm.cpp for the math, the
// shared argument setup and the autograd) and their registration at the CUDA key. fp32 math, block
// reductions through warp shuffles, launched on the current stream; inputs arrive contiguous and
// the weight as fp32.
// Fast path (rows a multiple of 16 bytes, aligned, up to 8 packs per thread): one block per row,
// 128-bit loads, the row kept in registers between the sum of squares and the write, so x is
// read once. The backward is persistent: a grid of a few blocks per multiprocessor walks the rows,
// each block summing its rows' weight-gradient terms in registers, then one small kernel adds the
// blocks' partial sums (deterministic, no atomics). Other shapes take the scalar kernels.
// The ops' own headers, not ATen/ATen.h (every op's declaration, a third of the compile time).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
// c10's stream header, not ATen/cuda/CUDAContext.h (which pulls in cuSPARSE/cuBLAS headers the
// compile-check toolkit lacks); c10::cuda::getCurrentCUDAStream is what at::cuda re-exports.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <type_traits>

#include "../common/cuda_vec.cuh"
#include "../common/dispatch.h"
#include "rms_norm.h"

namespace tp_ext::ops {
namespace {

using cuda::block_sum2;
using cuda::kVec;
using cuda::load_pack;
using cuda::Pack;
using cuda::store_pack;
using cuda::threads_for;

// Fast path: at most 512 threads (so the compiler may give each 128 registers) holding at most
// 8 packs of the row each; wider rows (> 32768 bf16, > 16384 fp32) take the scalar kernels.
constexpr int kMaxThreads = 512;
constexpr int kMaxPacks = 8;

__device__ __forceinline__ float block_sum(float v) { return block_sum2(v, 0.f).x; }

// Rounds through T, as the reference's `.to(x.dtype)`.
template <typename T>
__device__ __forceinline__ float round_t(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// ---- fast path ---------------------------------------------------------------------------------

template <typename T, typename O, bool kResidual, int kPacks>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_vec_kernel(const T* __restrict__ x, const T* __restrict__ res,
                        const float* __restrict__ w, float eps, int64_t hdim, O* __restrict__ out,
                        T* __restrict__ h) {
  constexpr int V = kVec<T>;
  const int64_t base = blockIdx.x * hdim;
  const int packs = static_cast<int>(hdim / V);
  float v[kPacks][V];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < packs) {
      const auto xp = load_pack<T, V>(x + base + c * V);
      if constexpr (kResidual) {
        const auto rp = load_pack<T, V>(res + base + c * V);
        Pack<T, V> hp;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          hp.v[k] = static_cast<T>(static_cast<float>(xp.v[k]) + static_cast<float>(rp.v[k]));
          v[i][k] = static_cast<float>(hp.v[k]);
        }
        store_pack(h + base + c * V, hp);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) v[i][k] = static_cast<float>(xp.v[k]);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) ss += v[i][k] * v[i][k];
    }
  }
  const float rstd = rsqrtf(block_sum(ss) / static_cast<float>(hdim) + eps);
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < packs) {
      const auto wp = load_pack<float, V>(w + c * V);  // 128-bit loads of the weight too
      Pack<O, V> o;
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = static_cast<O>(wp.v[k] * round_t<T>(v[i][k] * rstd));
      store_pack(out + base + c * V, o);
    }
  }
}

// grad_x for each row this block walks, and the block's partial weight gradient [gridDim.x, H].
template <typename T, typename G, int kPacks>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_backward_vec_kernel(const G* __restrict__ g, const T* __restrict__ x,
                                 const float* __restrict__ w, float eps, int64_t n, int64_t hdim,
                                 T* __restrict__ gx, float* __restrict__ gw_partial) {
  constexpr int V = kVec<T>;
  const int packs = static_cast<int>(hdim / V);
  float dw[kPacks][V];
#pragma unroll
  for (int i = 0; i < kPacks; ++i)
#pragma unroll
    for (int k = 0; k < V; ++k) dw[i][k] = 0.f;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const int64_t base = row * hdim;
    float xv[kPacks][V], gv[kPacks][V];
    float ss = 0.f, dot = 0.f;
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < packs) {
        const auto xp = load_pack<T, V>(x + base + c * V);
        const auto gp = load_pack<G, V>(g + base + c * V);
        const auto wp = load_pack<float, V>(w + c * V);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          xv[i][k] = static_cast<float>(xp.v[k]);
          gv[i][k] = static_cast<float>(gp.v[k]);
          ss += xv[i][k] * xv[i][k];
          dot += gv[i][k] * wp.v[k] * xv[i][k];
        }
      }
    }
    const float2 sums = block_sum2(ss, dot);
    const float rstd = rsqrtf(sums.x / static_cast<float>(hdim) + eps);
    const float c3 = rstd * rstd * rstd * sums.y / static_cast<float>(hdim);
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < packs) {
        const auto wp = load_pack<float, V>(w + c * V);  // again: from L1, not held
        Pack<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          o.v[k] = static_cast<T>(gv[i][k] * wp.v[k] * rstd - xv[i][k] * c3);
          dw[i][k] += gv[i][k] * round_t<T>(xv[i][k] * rstd);
        }
        store_pack(gx + base + c * V, o);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < packs)
#pragma unroll
      for (int k = 0; k < V; ++k) gw_partial[blockIdx.x * hdim + c * V + k] = dw[i][k];
  }
}

// out[j] = sum over rows of partial[:, j]; blocks of 32 columns x 8 row lanes (coalesced reads).
__global__ void column_sum_kernel(const float* __restrict__ partial, int64_t rows, int64_t cols,
                                  float* __restrict__ out) {
  __shared__ float lanes[8][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (col < cols)
    for (int64_t r = threadIdx.y; r < rows; r += 8) acc += partial[r * cols + col];
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f;
    for (int k = 0; k < 8; ++k) total += lanes[k][threadIdx.x];
    out[col] = total;
  }
}

// Threads for `packs` packs per row: enough that each holds at most 4 (up to 8 past 2048).
int vec_threads(int64_t packs) {
  int t = 32;
  while (t < kMaxThreads && t * 4 < packs) t *= 2;
  return t;
}

// Calls fn(std::integral_constant<int, P>) for the smallest P in {1, 2, 4, 8} >= per.
template <typename Fn>
void with_packs(int64_t per, Fn&& fn) {
  if (per <= 1)
    fn(std::integral_constant<int, 1>());
  else if (per <= 2)
    fn(std::integral_constant<int, 2>());
  else if (per <= 4)
    fn(std::integral_constant<int, 4>());
  else
    fn(std::integral_constant<int, 8>());
}

// The fast path takes rows of whole packs of T that fit kMaxPacks per thread, x-typed pointers
// 16-byte aligned, and `other` (a tensor of another dtype U) and the fp32 weight `w` aligned to
// their packs of kVec<T>. Not for fp64, whose math here is fp32 anyway (the scalar kernels).
template <typename T>
constexpr bool kHasFastPath = !std::is_same_v<T, double>;

template <typename T, typename U>
bool vectorizable(int64_t hdim, std::initializer_list<const void*> ptrs, const U* other,
                  const float* w) {
  constexpr int V = kVec<T>;
  return hdim % V == 0 && hdim / V <= static_cast<int64_t>(kMaxThreads) * kMaxPacks &&
         cuda::aligned_to(16, ptrs) &&
         cuda::aligned_to(static_cast<int64_t>(sizeof(U)) * V, {other}) &&
         cuda::aligned_to(static_cast<int64_t>(sizeof(float)) * V, {w});
}

// ---- scalar path (any width or alignment) ------------------------------------------------------

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
template <typename T, typename G>
__global__ void rms_norm_backward_kernel(const G* __restrict__ g, const T* __restrict__ x,
                                         const float* __restrict__ w, float eps, int64_t hdim,
                                         T* __restrict__ gx, float* __restrict__ rstd_out) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * hdim;
  const G* gr = g + row * hdim;
  float ss = 0.f, dot = 0.f;
  for (int64_t j = threadIdx.x; j < hdim; j += blockDim.x) {
    const float v = static_cast<float>(xr[j]);
    ss += v * v;
    dot += static_cast<float>(gr[j]) * w[j] * v;
  }
  const float2 sums = block_sum2(ss, dot);
  const float rstd = rsqrtf(sums.x / static_cast<float>(hdim) + eps);
  const float c3 = rstd * rstd * rstd * sums.y / static_cast<float>(hdim);
  for (int64_t j = threadIdx.x; j < hdim; j += blockDim.x)
    gx[row * hdim + j] =
        static_cast<T>(static_cast<float>(gr[j]) * w[j] * rstd - static_cast<float>(xr[j]) * c3);
  if (threadIdx.x == 0) rstd_out[row] = rstd;
}

// Weight gradient: one thread per column, summing over rows (coalesced along each row).
template <typename T, typename G>
__global__ void rms_norm_weight_grad_kernel(const G* __restrict__ g, const T* __restrict__ x,
                                            const float* __restrict__ rstd, int64_t n, int64_t hdim,
                                            float* __restrict__ gw) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= hdim) return;
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i)
    acc += static_cast<float>(g[i * hdim + j]) *
           round_t<T>(static_cast<float>(x[i * hdim + j]) * rstd[i]);
  gw[j] = acc;
}

// ---- launches ----------------------------------------------------------------------------------

// x: contiguous [N, H]; w: contiguous fp32 [H]; out in the promoted dtype.
void rms_norm_cuda_launch(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                          double eps, at::Tensor& out, at::Tensor& h, cudaStream_t stream) {
  const int64_t hdim = x.size(-1), n = x.numel() / hdim;
  const bool with_res = residual.defined();
  const float e = static_cast<float>(eps);
  TP_EXT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_cuda", [&] {
    using T = scalar_t;
    const T* xp = x.const_data_ptr<T>();
    const T* rp = with_res ? residual.const_data_ptr<T>() : nullptr;
    T* hp = with_res ? h.data_ptr<T>() : nullptr;
    const float* wp = w.const_data_ptr<float>();
    auto launch = [&](auto* op) {
      using O = std::remove_pointer_t<decltype(op)>;
      if constexpr (kHasFastPath<T>) {
        if (vectorizable<T>(hdim, {xp, rp, hp}, op, wp)) {
          const int64_t packs = hdim / kVec<T>;
          const int threads = vec_threads(packs);
          with_packs((packs + threads - 1) / threads, [&](auto per) {
            if (with_res)
              rms_norm_vec_kernel<T, O, true, per()>
                  <<<n, threads, 0, stream>>>(xp, rp, wp, e, hdim, op, hp);
            else
              rms_norm_vec_kernel<T, O, false, per()>
                  <<<n, threads, 0, stream>>>(xp, rp, wp, e, hdim, op, hp);
          });
          return;
        }
      }
      if (with_res) {
        rms_norm_kernel<T, O, true>
            <<<n, threads_for(hdim), 0, stream>>>(xp, rp, wp, e, hdim, op, hp);
      } else {
        rms_norm_kernel<T, O, false>
            <<<n, threads_for(hdim), 0, stream>>>(xp, rp, wp, e, hdim, op, hp);
      }
    };
    if (out.scalar_type() == x.scalar_type())
      launch(out.data_ptr<T>());
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
  const float e = static_cast<float>(eps);
  TP_EXT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_backward_cuda", [&] {
    using T = scalar_t;
    auto launch = [&](const auto* gp) {
      using G = std::remove_const_t<std::remove_pointer_t<decltype(gp)>>;
      const T* xp = x.const_data_ptr<T>();
      const float* wp = w.const_data_ptr<float>();
      T* gxp = grad_x.data_ptr<T>();
      float* gwp = grad_w_f32.data_ptr<float>();
      if constexpr (kHasFastPath<T>) {
        if (vectorizable<T>(hdim, {xp, gxp}, gp, wp)) {
          const int64_t packs = hdim / kVec<T>;
          const int threads = vec_threads(packs);
          const int64_t blocks = std::min<int64_t>(n, 2 * cuda::multiprocessors());
          auto partial = at::empty({blocks, hdim}, x.options().dtype(at::kFloat));
          with_packs((packs + threads - 1) / threads, [&](auto per) {
            rms_norm_backward_vec_kernel<T, G, per()><<<blocks, threads, 0, stream>>>(
                gp, xp, wp, e, n, hdim, gxp, partial.data_ptr<float>());
          });
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          column_sum_kernel<<<(hdim + 31) / 32, dim3(32, 8), 0, stream>>>(
              partial.const_data_ptr<float>(), blocks, hdim, gwp);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          return;
        }
      }
      {
        auto rstd = at::empty({n}, x.options().dtype(at::kFloat));
        rms_norm_backward_kernel<T, G>
            <<<n, threads_for(hdim), 0, stream>>>(gp, xp, wp, e, hdim, gxp, rstd.data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        rms_norm_weight_grad_kernel<T, G><<<(hdim + 255) / 256, 256, 0, stream>>>(
            gp, xp, rstd.const_data_ptr<float>(), n, hdim, gwp);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    // grad in x's dtype (the usual case: the output's) or fp32 (rms_norm_backward_args)
    if (grad.scalar_type() == x.scalar_type())
      launch(grad.const_data_ptr<T>());
    else
      launch(grad.const_data_ptr<float>());
  });
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& x_in, const at::Tensor* res_in,
                                                const at::Tensor& weight, double eps,
                                                const char* op) {
  const c10::cuda::CUDAGuard guard(x_in.device());
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
  const c10::cuda::CUDAGuard guard(x_in.device());
  // grad stays in its dtype when it is x's (the output's, usually); fp32 otherwise
  const bool same = grad_in.scalar_type() == x_in.scalar_type();
  const auto in = rms_norm_backward_args(grad_in, x_in, weight, /*float_grad=*/!same);
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
