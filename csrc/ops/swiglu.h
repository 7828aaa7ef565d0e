// Shared by the CPU (swiglu.cpp) and CUDA (swiglu_cuda.cu) kernels of swiglu and swiglu_backward:
// the argument checks and the setup of inputs and outputs, so both devices raise the same errors.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace tp_ext::ops {

// gate_up is a dense floating-point tensor whose last dimension is even ([..., 2 * I]).
void check_gate_up(const at::Tensor& gate_up, const char* op);

// Shape of swiglu's output: gate_up's shape with the last dimension halved ([..., I]).
std::vector<int64_t> swiglu_out_shape(const at::Tensor& gate_up);

// Checked, contiguous inputs of swiglu_backward on any device, and its output (zeros when there
// is nothing to compute, so the kernels run only when grad has elements).
struct SwigluBackwardArgs {
  at::Tensor gate_up, grad, out;
};
SwigluBackwardArgs swiglu_backward_args(const at::Tensor& grad, const at::Tensor& gate_up);

}  // namespace tp_ext::ops
