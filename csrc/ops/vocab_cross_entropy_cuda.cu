// CUDA kernels of the local pieces of tp_ext.vocab_parallel_cross_entropy and their registration
// at the CUDA key (see vocab_cross_entropy.cpp for the maths and the CPU kernels; the argument
// checks are shared).
// One block per token row, threads striding over the vocabulary shard, fp32 accumulation (fp64
// for fp64 logits); no [tokens, vocab] temporaries beyond the logits and their gradient. Rows of
// whole 16-byte packs (aligned) are read and written a 128-bit pack per step.
#include <ATen/OpMathType.h>
// c10's stream header, not ATen/cuda/CUDAContext.h (which pulls in cuSPARSE/cuBLAS headers the
// compile-check toolkit lacks); c10::cuda::getCurrentCUDAStream is what at::cuda re-exports.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "../common/cuda_vec.cuh"
#include "../common/dispatch.h"
#include "vocab_cross_entropy.h"

namespace tp_ext::ops {
namespace {

using cuda::kThreads;
constexpr int kWarps = kThreads / 32;

struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return (b > a || b != b) ? b : a;  // NaN propagates, as on the CPU
  }
};
struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

// A row this block can read in 128-bit packs: whole packs, 16-byte aligned.
template <typename T>
__device__ __forceinline__ bool whole_packs(const T* row, int64_t v) {
  return v % cuda::kVec<T> == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0;
}

__device__ inline float dexp(float x) { return expf(x); }
__device__ inline double dexp(double x) { return exp(x); }

// One block per token: this shard's max of the row, then (the row again, now from L1/L2) the sum
// of exp(l - max) and of the logits. One read of the logits from memory.
template <typename scalar_t, typename acc_t>
__global__ void local_stats_kernel(const scalar_t* __restrict__ logits, acc_t* __restrict__ max_out,
                                   acc_t* __restrict__ sums, int64_t v) {
  __shared__ acc_t shared[kWarps];
  constexpr int V = cuda::kVec<scalar_t>;
  const int64_t i = blockIdx.x;
  const scalar_t* row = logits + i * v;
  const bool packed = whole_packs<scalar_t>(row, v);
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  if (packed) {
    for (int64_t c = threadIdx.x; c < v / V; c += blockDim.x) {
      const auto p = cuda::load_pack<scalar_t, V>(row + c * V);
#pragma unroll
      for (int e = 0; e < V; ++e) m = MaxOp()(m, static_cast<acc_t>(p.v[e]));
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x)
      m = MaxOp()(m, static_cast<acc_t>(row[j]));
  }
  m = cuda::block_reduce(m, MaxOp(), shared);
  acc_t sum_exp = 0, sum_logits = 0;
  if (packed) {
    for (int64_t c = threadIdx.x; c < v / V; c += blockDim.x) {
      const auto p = cuda::load_pack<scalar_t, V>(row + c * V);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const acc_t x = static_cast<acc_t>(p.v[e]);
        sum_exp += dexp(x - m);
        sum_logits += x;
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
      const acc_t x = static_cast<acc_t>(row[j]);
      sum_exp += dexp(x - m);
      sum_logits += x;
    }
  }
  sum_exp = cuda::block_reduce(sum_exp, SumOp(), shared);
  sum_logits = cuda::block_reduce(sum_logits, SumOp(), shared);
  if (threadIdx.x == 0) {
    max_out[i] = m;
    sums[2 * i] = sum_exp;
    sums[2 * i + 1] = sum_logits;
  }
}

template <typename scalar_t, typename acc_t>
__global__ void local_grad_kernel(const scalar_t* __restrict__ logits,
                                  const int64_t* __restrict__ target,
                                  const acc_t* __restrict__ grad, const acc_t* __restrict__ lse,
                                  scalar_t* __restrict__ out, int64_t v, int64_t vocab_start,
                                  int64_t ignore_index, acc_t eps, acc_t smooth) {
  const int64_t i = blockIdx.x;
  const scalar_t* row = logits + i * v;
  scalar_t* grow = out + i * v;
  const int64_t t = target[i];
  if (t == ignore_index) {
    for (int64_t j = threadIdx.x; j < v; j += blockDim.x) grow[j] = scalar_t(0);
    return;
  }
  const acc_t g = grad[i], l = lse[i];
  const int64_t local = t - vocab_start;  // outside [0, v) when another rank holds the target
  constexpr int V = cuda::kVec<scalar_t>;
  if (whole_packs<scalar_t>(row, v) && whole_packs<scalar_t>(grow, v)) {
    for (int64_t c = threadIdx.x; c < v / V; c += blockDim.x) {
      const auto p = cuda::load_pack<scalar_t, V>(row + c * V);
      cuda::Pack<scalar_t, V> o;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        acc_t d = dexp(static_cast<acc_t>(p.v[e]) - l) - smooth;
        if (c * V + e == local) d -= acc_t(1) - eps;
        o.v[e] = static_cast<scalar_t>(g * d);
      }
      cuda::store_pack(grow + c * V, o);
    }
    return;
  }
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    acc_t d = dexp(static_cast<acc_t>(row[j]) - l) - smooth;
    if (j == local) d -= acc_t(1) - eps;
    grow[j] = static_cast<scalar_t>(g * d);
  }
}

std::tuple<at::Tensor, at::Tensor> local_stats_cuda(const at::Tensor& logits, int64_t group_size,
                                                    int64_t group_rank) {
  const c10::cuda::CUDAGuard guard(logits.device());
  auto a = prepare_local_stats(logits, group_size, group_rank);
  if (a.rows.n == 0) return {a.max_sizes, a.sums};
  TP_EXT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "vocab_ce_local_stats_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    local_stats_kernel<scalar_t, acc_t>
        <<<a.rows.n, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            a.rows.logits.const_data_ptr<scalar_t>(), a.max_sizes.data_ptr<acc_t>(),
            a.sums.data_ptr<acc_t>(), a.rows.v);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {a.max_sizes, a.sums};
}

at::Tensor local_grad_cuda(const at::Tensor& grad_loss, const at::Tensor& logits,
                           const at::Tensor& target, const at::Tensor& max_sizes,
                           const at::Tensor& lse, int64_t ignore_index, double label_smoothing,
                           int64_t group_rank) {
  const c10::cuda::CUDAGuard guard(logits.device());
  auto a = prepare_grad(grad_loss, logits, target, max_sizes, lse, label_smoothing, group_rank);
  if (a.rows.n == 0 || a.rows.v == 0) return a.out;
  TP_EXT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "vocab_ce_local_grad_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t eps = static_cast<acc_t>(label_smoothing);
    const acc_t smooth = a.layout.vocab > 0 ? eps / static_cast<acc_t>(a.layout.vocab) : acc_t(0);
    local_grad_kernel<scalar_t, acc_t>
        <<<a.rows.n, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            a.rows.logits.const_data_ptr<scalar_t>(), a.target.const_data_ptr<int64_t>(),
            a.g.const_data_ptr<acc_t>(), a.lse.const_data_ptr<acc_t>(), a.out.data_ptr<scalar_t>(),
            a.rows.v, a.layout.vocab_start, ignore_index, eps, smooth);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return a.out;
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("vocab_ce_local_stats", &tp_ext::ops::local_stats_cuda);
  m.impl("vocab_ce_local_grad", &tp_ext::ops::local_grad_cuda);
}
