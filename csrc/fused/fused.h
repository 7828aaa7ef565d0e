// Fused elementwise / row kernels (RMSNorm, add+RMSNorm, SwiGLU): shared checks and the CUDA
// launchers (defined in the .cu files, registered from the .cpp files under TP_EXT_WITH_CUDA).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace tp_ext::fused {

// Checks x / weight for rms_norm-style ops and returns the output dtype (torch's promotion of
// x and weight, as the reference `weight * normed.to(x.dtype)` gives).
at::ScalarType check_rms_args(const at::Tensor& x, const at::Tensor& weight, const char* op);

#ifdef TP_EXT_WITH_CUDA
// `stream` is the current cudaStream_t (c10::cuda::getCurrentCUDAStream(), taken in the .cpp so
// the .cu files need no c10/cuda headers).
// x, grad: contiguous [N, H]; weight: contiguous fp32 [H]; out_dtype as check_rms_args.
void rms_norm_cuda_launch(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                          double eps, at::Tensor& out, at::Tensor& h, void* stream);
void rms_norm_backward_cuda_launch(const at::Tensor& grad, const at::Tensor& x,
                                   const at::Tensor& w, double eps, at::Tensor& grad_x,
                                   at::Tensor& grad_w_f32, void* stream);
void swiglu_cuda_launch(const at::Tensor& gate_up, at::Tensor& out, void* stream);
void swiglu_backward_cuda_launch(const at::Tensor& grad, const at::Tensor& gate_up,
                                 at::Tensor& grad_gate_up, void* stream);
#endif

}  // namespace tp_ext::fused
