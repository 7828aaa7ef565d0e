// Shared by the CPU (grad_compression.cpp) and CUDA (grad_compression_cuda.cu) kernels of the
// gradient compression ops: argument checks and the setup of inputs and outputs, so both devices
// raise the same errors and agree on the layout of what they produce.
//
// Layout: a gradient of n elements is cut into chunks of chunk_size elements (the last may be
// shorter), each with one fp32 scale. int8: codes[i] = round(v[i] / scale) in [-127, 127], scale
// = max |v| over the chunk / 127. 1-bit: bit i % 8 of byte i / 8 is 1 where v[i] >= 0, scale =
// mean |v| over the chunk, and the value sent is +scale or -scale; chunk_size is a multiple of 8,
// so every chunk starts on a byte. v = grad + residual (fp32): the error feedback, and the
// residual becomes v - what was sent.
#pragma once

#include <ATen/core/Tensor.h>

namespace tp_ext::ops {

int64_t num_chunks(int64_t numel, int64_t chunk_size);

// Checked, contiguous inputs of quantize_*_ef on any device and its outputs: grad (1-D, floating,
// any dtype), residual (fp32, grad's numel, updated in place: contiguous, so the kernels write
// it directly), codes (int8 [n] or uint8 [ceil(n / 8)]) and scales (fp32 [chunks]).
struct QuantizeArgs {
  at::Tensor grad, residual, codes, scales;
};
QuantizeArgs quantize_args(const at::Tensor& grad, const at::Tensor& residual, int64_t chunk_size,
                           bool one_bit, const char* op);

// Checked inputs of dequantize_*: codes and scales as quantize_*_ef gives them for numel
// elements, and the fp32 output [numel].
struct DequantizeArgs {
  at::Tensor codes, scales, out;
};
DequantizeArgs dequantize_args(const at::Tensor& codes, const at::Tensor& scales,
                               int64_t chunk_size, int64_t numel, bool one_bit, const char* op);

}  // namespace tp_ext::ops
