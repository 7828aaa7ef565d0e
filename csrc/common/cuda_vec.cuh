// 128-bit vector access and block reductions for tp_ext's memory-bound CUDA kernels (included by
// .cu files only). A kernel reads and writes whole Packs of kVec<T> elements (16 bytes: 8 bf16 /
// fp16, 4 fp32, 2 fp64) when its rows allow it (vectorizable(): width a multiple of the pack,
// pointers 16-byte aligned), and falls back to its scalar loop otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

namespace tp_ext::cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements per 16-byte access.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// True when every pointer is aligned to `bytes` (nullptr counts as aligned).
inline bool aligned_to(int64_t bytes, std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) != 0) return false;
  return true;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sums a and b over the block (up to 1024 threads, blockDim.x a multiple of 32); every thread
// gets both sums. Safe to call back to back (the shared slots are read before the next write).
__device__ __forceinline__ float2 block_sum2(float a, float b) {
  __shared__ float2 partial[32];
  __shared__ float2 total;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  a = warp_sum(a);
  b = warp_sum(b);
  if (lane == 0) partial[warp] = make_float2(a, b);
  __syncthreads();
  if (warp == 0) {
    float2 s = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : make_float2(0.f, 0.f);
    s.x = warp_sum(s.x);
    s.y = warp_sum(s.y);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// Threads per block of tp_ext's one-dimensional kernels (8 warps).
constexpr int kThreads = 256;

// Reduces one value per thread over a block of exactly kThreads threads by `op`; every thread
// gets the result. `shared` holds kThreads / 32 values; the leading __syncthreads lets callers
// reuse it back to back.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = shared[0];
  for (int w = 1; w < kThreads / 32; ++w) v = op(v, shared[w]);
  return v;
}

// Threads for a block that covers `n` elements, a row or a chunk: whole warps (the block
// reductions and ballots need them), a power of two, at most kThreads.
inline int threads_for(int64_t n) {
  int t = 32;
  while (t < kThreads && t < n) t *= 2;
  return t;
}

// Multiprocessors of the current device (grid sizes of persistent kernels).
inline int multiprocessors() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count > 0 ? count : 1;
}

}  // namespace tp_ext::cuda
