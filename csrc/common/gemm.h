// The GEMMs of tp_ext's linear ops, in one place so every op picks the same kernel.
//
// On CPU in float32 they run through oneDNN's matmul (mkldnn::_linear_pointwise, the kernel
// torch.compile's CPU backend picks for linear layers) where this torch build has it: on AMD EPYC
// (Zen 4) it is 13-30% faster than the MKL sgemm behind aten::mm and aten::linear for the layers'
// forward and input-gradient GEMMs (benchmarks/bench_kernels.py --kernels linear --threads 1).
// A GEMM whose first operand is strided (the weight gradient's grad^T) stays aten's: oneDNN's op
// would copy it, a transient the size of the output gradient. Everything else (CUDA, other
// dtypes, empty tensors, a build without oneDNN, or the setting "aten") takes aten's own kernels.
// Both accumulate in fp32; only the summation order differs.
//
// The setting: TP_EXT_CPU_GEMM=onednn (default) / aten, or set_cpu_gemm() (tp_ext.ops.set_cpu_gemm)
// at run time. Every rank must use the same one, as every rank runs the same kernels.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace tp_ext {

// y = x W^T (+ b): x [..., in], weight [out, in], bias [out] or undefined.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// a @ b for a [..., k] and a 2-D b [k, n] (b may be a transposed view): [..., n].
at::Tensor matmul(const at::Tensor& a, const at::Tensor& b);

// out += a @ b, for 2-D out [m, n], a [m, k] and b [k, n].
void add_matmul_(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

// "onednn" or "aten": the setting above (an invalid TP_EXT_CPU_GEMM raises here, naming it).
std::string cpu_gemm();
void set_cpu_gemm(const std::string& name);

}  // namespace tp_ext
