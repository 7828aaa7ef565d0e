// Shared by the CPU (rms_norm.cpp) and CUDA (rms_norm_cuda.cu) kernels of rms_norm, add_rms_norm
// and rms_norm_backward: the argument checks and the setup of inputs and outputs, so both devices
// raise the same errors and compute from the same layouts.
#pragma once

#include <ATen/core/Tensor.h>

namespace tp_ext::ops {

// Checks x / weight for rms_norm-style ops and returns the output dtype (torch's promotion of
// x and weight, as the reference `weight * normed.to(x.dtype)` gives).
at::ScalarType check_rms_args(const at::Tensor& x, const at::Tensor& weight, const char* op);

// add_rms_norm: residual matches x in shape, dtype and device.
void check_residual(const at::Tensor& x, const at::Tensor& residual);

// Checked, contiguous inputs and the outputs of rms_norm / add_rms_norm on any device: weight in
// fp32, h (= x + residual) only with a residual, out in the promoted dtype.
struct RmsNormArgs {
  at::ScalarType out_dtype;
  at::Tensor x, w, res, h, out;
};
RmsNormArgs rms_norm_args(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                          const char* op);

// Checked, contiguous inputs of rms_norm_backward on any device; weight in fp32, where the math
// is done, and grad in fp32 too unless float_grad is false (the CUDA kernels read grad in its own
// dtype, the output's, rather than pay a conversion pass).
struct RmsNormBackwardArgs {
  at::Tensor x, grad, weight;
};
RmsNormBackwardArgs rms_norm_backward_args(const at::Tensor& grad, const at::Tensor& x,
                                           const at::Tensor& weight, bool float_grad = true);

}  // namespace tp_ext::ops
