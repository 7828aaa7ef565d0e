// CUDA kernels of sampling_kept_mass and sampling_pick and their registration at the CUDA key (the
// maths and the CPU kernels: sampling.cpp; the argument checks are shared; sampling_candidates and
// sampling_threshold are ATen compositions registered for CUDA there).
// One block of kThreads per row; s = float(logit) / temperature (a true division, as on the CPU),
// accumulation in fp32 (fp64 for fp64 logits). A token is kept when s >= threshold and s > -inf.
//   kept_mass: threads stride over the row (coalesced), one block sum.
//   pick: thread k owns the contiguous segment [k L, (k + 1) L) of the row (L = ceil(V /
//   kThreads));
//     pass 1: each segment's kept mass (summed in order), its first and last kept token;
//     an exclusive scan of the segment masses (in thread order = token order) gives each
//     segment's base; the first thread whose base + mass passes target (k*) scans its segment again
//     from its base, in order, for the first kept token whose running sum passes target. If
//     rounding keeps that scan under target, the first kept token after segment k* is taken (the
//     crossing is at the segment's end up to rounding); if no segment passes target, the last kept
//     token; if no token is kept, -1.
#include <ATen/OpMathType.h>
// c10's stream header, not ATen/cuda/CUDAContext.h (which pulls in cuSPARSE/cuBLAS headers the
// compile-check toolkit lacks); c10::cuda::getCurrentCUDAStream is what at::cuda re-exports.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "../common/cuda_vec.cuh"
#include "../common/dispatch.h"
#include "sampling.h"

// Helpers in a namespace of their own: scripts/check_cuda_compile.sh compiles several .cu files
// as one unit, where anonymous-namespace names of different files would clash.
namespace tp_ext::ops::sampling_kernels {
namespace {

using cuda::kThreads;  // every kernel here runs blocks of exactly kThreads threads
constexpr int kWarps = kThreads / 32;
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MinOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return b < a ? b : a;
  }
};
struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return b > a ? b : a;
  }
};

// The sum of the values of the threads before this one (thread order); `shared` holds kWarps
// values. A shuffle scan within each warp, then the totals of the warps before this one's.
template <typename T>
__device__ T block_exclusive_sum(T v, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inclusive = v;
  for (int o = 1; o < 32; o *= 2) {
    const T up = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  T exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) exclusive = T(0);
  __syncthreads();
  if (lane == 31) shared[warp] = inclusive;
  __syncthreads();
  T offset = T(0);
  for (int w = 0; w < warp; ++w) offset += shared[w];
  return offset + exclusive;
}

__device__ inline float dexp(float x) { return expf(x); }
__device__ inline double dexp(double x) { return exp(x); }

template <typename acc_t>
__device__ __forceinline__ bool is_kept(acc_t s, acc_t cut) {
  return s >= cut && s > -std::numeric_limits<acc_t>::infinity();
}

template <typename scalar_t, typename acc_t>
__global__ void kept_mass_kernel(const scalar_t* __restrict__ logits,
                                 const acc_t* __restrict__ threshold,
                                 const acc_t* __restrict__ row_max, acc_t* __restrict__ out,
                                 int64_t v, acc_t temperature) {
  __shared__ acc_t shared[kWarps];
  const int64_t b = blockIdx.x;
  const scalar_t* row = logits + b * v;
  const acc_t cut = threshold[b], m = row_max[b];
  acc_t sum = 0;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    const acc_t s = static_cast<acc_t>(row[i]) / temperature;
    if (is_kept(s, cut)) sum += dexp(s - m);
  }
  sum = cuda::block_reduce(sum, SumOp(), shared);
  if (threadIdx.x == 0) out[b] = sum;
}

template <typename scalar_t, typename acc_t>
__global__ void pick_kernel(const scalar_t* __restrict__ logits,
                            const acc_t* __restrict__ threshold, const acc_t* __restrict__ row_max,
                            const acc_t* __restrict__ target, int64_t* __restrict__ out, int64_t v,
                            acc_t temperature) {
  __shared__ acc_t shared_acc[kWarps];
  __shared__ int64_t shared_idx[kWarps];
  const int64_t b = blockIdx.x;
  const scalar_t* row = logits + b * v;
  const acc_t cut = threshold[b], m = row_max[b], goal = target[b];
  const int64_t seg = (v + kThreads - 1) / kThreads;
  const int64_t k = threadIdx.x;
  const int64_t begin = k * seg < v ? k * seg : v;
  const int64_t end = begin + seg < v ? begin + seg : v;

  // Pass 1: this segment's kept mass, first and last kept token.
  acc_t mass = 0;
  int64_t first = -1, last = -1;
  for (int64_t i = begin; i < end; ++i) {
    const acc_t s = static_cast<acc_t>(row[i]) / temperature;
    if (!is_kept(s, cut)) continue;
    mass += dexp(s - m);
    if (first < 0) first = i;
    last = i;
  }
  const acc_t base = block_exclusive_sum(mass, shared_acc);
  // k*: the first segment whose inclusive sum passes target (kNone: none does).
  const int64_t crossing = cuda::block_reduce(base + mass > goal ? k : kNone, MinOp(), shared_idx);

  int64_t found = kNone;
  if (crossing != kNone) {
    if (k == crossing) {  // pass 2, this segment only: where the running sum passes target
      acc_t running = base;
      for (int64_t i = begin; i < end; ++i) {
        const acc_t s = static_cast<acc_t>(row[i]) / temperature;
        if (!is_kept(s, cut)) continue;
        running += dexp(s - m);
        if (running > goal) {
          found = i;
          break;
        }
      }
    } else if (k > crossing && first >= 0) {  // in case rounding kept segment k* under target
      found = first;
    }
  }
  found = cuda::block_reduce(found, MinOp(), shared_idx);
  if (found == kNone) found = cuda::block_reduce(last, MaxOp(), shared_idx);  // -1: nothing kept
  if (threadIdx.x == 0) out[b] = found;
}

at::Tensor kept_mass_cuda(const at::Tensor& logits, double temperature, const at::Tensor& threshold,
                          const at::Tensor& row_max) {
  const c10::cuda::CUDAGuard guard(logits.device());
  auto a = prepare_kept_mass(logits, temperature, threshold, row_max);
  if (a.rows == 0) return a.out;
  TP_EXT_DISPATCH_FLOATING_TYPES(a.logits.scalar_type(), "sampling_kept_mass_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    kept_mass_kernel<scalar_t, acc_t><<<a.rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        a.logits.const_data_ptr<scalar_t>(), a.threshold.const_data_ptr<acc_t>(),
        a.row_max.const_data_ptr<acc_t>(), a.out.data_ptr<acc_t>(), a.vocab,
        static_cast<acc_t>(temperature));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return a.out;
}

at::Tensor pick_cuda(const at::Tensor& logits, double temperature, const at::Tensor& threshold,
                     const at::Tensor& row_max, const at::Tensor& target) {
  const c10::cuda::CUDAGuard guard(logits.device());
  auto a = prepare_pick(logits, temperature, threshold, row_max, target);
  if (a.rows == 0) return a.out;
  TP_EXT_DISPATCH_FLOATING_TYPES(a.logits.scalar_type(), "sampling_pick_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    pick_kernel<scalar_t, acc_t><<<a.rows, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        a.logits.const_data_ptr<scalar_t>(), a.threshold.const_data_ptr<acc_t>(),
        a.row_max.const_data_ptr<acc_t>(), a.target.const_data_ptr<acc_t>(),
        a.out.data_ptr<int64_t>(), a.vocab, static_cast<acc_t>(temperature));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return a.out;
}

}  // namespace
}  // namespace tp_ext::ops::sampling_kernels

TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("sampling_kept_mass", &tp_ext::ops::sampling_kernels::kept_mass_cuda);
  m.impl("sampling_pick", &tp_ext::ops::sampling_kernels::pick_cuda);
}
