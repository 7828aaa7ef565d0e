// Gradient compression for data parallelism: per-chunk int8 and 1-bit quantisation fused with the
// error-feedback update, and their dequantisation (layout: grad_compression.h). The shared
// argument setup and the CPU kernels; CUDA kernels: grad_compression_cuda.cu. No autograd: these
// run on gradients inside DDP communication hooks (tp_ext/compression/).
//
//   quantize_int8_ef(grad, residual, chunk_size) -> (codes int8 [n], scales fp32 [chunks])
//   dequantize_int8(codes, scales, chunk_size) -> fp32 [n]
//   quantize_1bit_ef(grad, residual, chunk_size) -> (bits uint8 [ceil(n / 8)], scales)
//   dequantize_1bit(bits, scales, chunk_size, numel) -> fp32 [numel]
// The quantisers update residual in place to v - dequantized(v), v = grad + residual, so what
// was sent plus the residual is always the gradients' running sum (to fp32 rounding).
#include "grad_compression.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../common/checks.h"
#include "../common/dispatch.h"

namespace tp_ext::ops {

int64_t num_chunks(int64_t numel, int64_t chunk_size) {
  return (numel + chunk_size - 1) / chunk_size;
}

namespace {

void check_chunk_size(int64_t chunk_size, bool one_bit, const char* op) {
  TORCH_CHECK_VALUE(chunk_size >= 1, "tp_ext.", op, ": chunk_size must be >= 1, got ", chunk_size,
                    ".");
  TORCH_CHECK_VALUE(!one_bit || chunk_size % 8 == 0, "tp_ext.", op,
                    ": chunk_size must be a multiple of 8 (each chunk starts on a byte of 8 "
                    "signs), got ",
                    chunk_size, ".");
}

}  // namespace

QuantizeArgs quantize_args(const at::Tensor& grad, const at::Tensor& residual, int64_t chunk_size,
                           bool one_bit, const char* op) {
  check_chunk_size(chunk_size, one_bit, op);
  TORCH_CHECK_VALUE(grad.defined() && grad.layout() == at::kStrided && grad.dim() == 1, "tp_ext.",
                    op, ": grad must be a dense 1-D tensor (a flattened gradient bucket), got ",
                    grad.defined() ? shape_str(grad.sizes()) : std::string("undefined"), ".");
  TORCH_CHECK_VALUE(at::isFloatingType(grad.scalar_type()), "tp_ext.", op,
                    ": grad must be floating point, got ", grad.scalar_type(), ".");
  TORCH_CHECK_VALUE(residual.defined() && residual.scalar_type() == at::kFloat &&
                        residual.dim() == 1 && residual.is_contiguous(),
                    "tp_ext.", op,
                    ": residual must be a contiguous 1-D float32 tensor (updated in place), got ",
                    residual.defined() ? c10::toString(residual.scalar_type()) : "undefined", " ",
                    residual.defined() ? shape_str(residual.sizes()) : std::string(""), ".");
  TORCH_CHECK_VALUE(residual.numel() == grad.numel(), "tp_ext.", op, ": residual has ",
                    residual.numel(), " elements but grad has ", grad.numel(),
                    "; they must match (one residual per gradient element).");
  TORCH_CHECK_VALUE(residual.device() == grad.device(), "tp_ext.", op, ": residual is on ",
                    residual.device(), " but grad is on ", grad.device(), ".");
  const int64_t n = grad.numel();
  auto codes = one_bit ? at::zeros({(n + 7) / 8}, grad.options().dtype(at::kByte))
                       : at::empty({n}, grad.options().dtype(at::kChar));
  auto scales = at::empty({num_chunks(n, chunk_size)}, grad.options().dtype(at::kFloat));
  return {grad.contiguous(), residual, codes, scales};
}

DequantizeArgs dequantize_args(const at::Tensor& codes, const at::Tensor& scales,
                               int64_t chunk_size, int64_t numel, bool one_bit, const char* op) {
  check_chunk_size(chunk_size, one_bit, op);
  const auto want = one_bit ? at::kByte : at::kChar;
  TORCH_CHECK_VALUE(codes.defined() && codes.dim() == 1 && codes.scalar_type() == want, "tp_ext.",
                    op, ": codes must be a 1-D ", c10::toString(want), " tensor, got ",
                    codes.defined() ? c10::toString(codes.scalar_type()) : "undefined", ".");
  TORCH_CHECK_VALUE(numel >= 0, "tp_ext.", op, ": numel must be >= 0, got ", numel, ".");
  const int64_t expected = one_bit ? (numel + 7) / 8 : numel;
  TORCH_CHECK_VALUE(codes.numel() == expected, "tp_ext.", op, ": codes has ", codes.numel(),
                    " entries; ", numel, " elements need ", expected, ".");
  TORCH_CHECK_VALUE(scales.defined() && scales.dim() == 1 && scales.scalar_type() == at::kFloat,
                    "tp_ext.", op, ": scales must be a 1-D float32 tensor.");
  TORCH_CHECK_VALUE(scales.numel() == num_chunks(numel, chunk_size), "tp_ext.", op, ": scales has ",
                    scales.numel(), " entries; ", numel, " elements in chunks of ", chunk_size,
                    " need ", num_chunks(numel, chunk_size), ".");
  TORCH_CHECK_VALUE(scales.device() == codes.device(), "tp_ext.", op, ": scales is on ",
                    scales.device(), " but codes is on ", codes.device(), ".");
  auto out = at::empty({numel}, scales.options());
  return {codes.contiguous(), scales.contiguous(), out};
}

namespace {

using Vec = at::vec::Vectorized<float>;

// v = grad + residual over [begin, end), written to residual; returns (max |v|, sum |v|). fp32
// gradients (the common case) on vector lanes.
template <typename T>
std::pair<float, float> add_residual(const T* grad, float* residual, int64_t begin, int64_t end) {
  float max_abs = 0.f, sum_abs = 0.f;
  int64_t i = begin;
  if constexpr (std::is_same_v<T, float>) {
    Vec lane_max(0.f), lane_sum(0.f);
    for (; i + Vec::size() <= end; i += Vec::size()) {
      const Vec v = Vec::loadu(grad + i) + Vec::loadu(residual + i);
      v.store(residual + i);
      lane_max = at::vec::maximum(lane_max, v.abs());
      lane_sum = lane_sum + v.abs();
    }
    float maxes[Vec::size()], sums[Vec::size()];
    lane_max.store(maxes);
    lane_sum.store(sums);
    for (int64_t l = 0; l < Vec::size(); ++l) {
      max_abs = std::max(max_abs, maxes[l]);
      sum_abs += sums[l];
    }
  }
  for (; i < end; ++i) {
    const float v = static_cast<float>(grad[i]) + residual[i];
    residual[i] = v;
    const float a = std::fabs(v);
    max_abs = std::max(max_abs, a);
    sum_abs += a;
  }
  return {max_abs, sum_abs};
}

template <typename T>
void quantize_int8_cpu_impl(const QuantizeArgs& a, int64_t chunk) {
  const T* grad = a.grad.const_data_ptr<T>();
  float* residual = a.residual.mutable_data_ptr<float>();
  int8_t* codes = a.codes.mutable_data_ptr<int8_t>();
  float* scales = a.scales.mutable_data_ptr<float>();
  const int64_t n = a.grad.numel();
  at::parallel_for(0, a.scales.numel(), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk, end = std::min(n, begin + chunk);
      const float scale = add_residual(grad, residual, begin, end).first / 127.f;
      scales[c] = scale;
      for (int64_t i = begin; i < end; ++i) {
        const float q = scale > 0.f ? std::nearbyint(residual[i] / scale) : 0.f;
        codes[i] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
        residual[i] -= q * scale;
      }
    }
  });
}

template <typename T>
void quantize_1bit_cpu_impl(const QuantizeArgs& a, int64_t chunk) {
  const T* grad = a.grad.const_data_ptr<T>();
  float* residual = a.residual.mutable_data_ptr<float>();
  uint8_t* bits = a.codes.mutable_data_ptr<uint8_t>();
  float* scales = a.scales.mutable_data_ptr<float>();
  const int64_t n = a.grad.numel();
  at::parallel_for(0, a.scales.numel(), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk, end = std::min(n, begin + chunk);
      const float scale =
          add_residual(grad, residual, begin, end).second / static_cast<float>(end - begin);
      scales[c] = scale;
      // chunk is a multiple of 8: this chunk's bytes are its own (no other thread writes them)
      for (int64_t i = begin; i < end; ++i) {
        const bool positive = residual[i] >= 0.f;
        bits[i / 8] |= static_cast<uint8_t>(positive) << (i % 8);
        residual[i] -= positive ? scale : -scale;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_ef_cpu(const at::Tensor& grad,
                                                        const at::Tensor& residual,
                                                        int64_t chunk_size) {
  auto a = quantize_args(grad, residual, chunk_size, false, "quantize_int8_ef");
  if (a.grad.numel() > 0) {
    TP_EXT_DISPATCH_FLOATING_TYPES(a.grad.scalar_type(), "quantize_int8_ef",
                                   [&] { quantize_int8_cpu_impl<scalar_t>(a, chunk_size); });
  }
  return {a.codes, a.scales};
}

std::tuple<at::Tensor, at::Tensor> quantize_1bit_ef_cpu(const at::Tensor& grad,
                                                        const at::Tensor& residual,
                                                        int64_t chunk_size) {
  auto a = quantize_args(grad, residual, chunk_size, true, "quantize_1bit_ef");
  if (a.grad.numel() > 0) {
    TP_EXT_DISPATCH_FLOATING_TYPES(a.grad.scalar_type(), "quantize_1bit_ef",
                                   [&] { quantize_1bit_cpu_impl<scalar_t>(a, chunk_size); });
  }
  return {a.codes, a.scales};
}

at::Tensor dequantize_int8_cpu(const at::Tensor& codes, const at::Tensor& scales,
                               int64_t chunk_size) {
  auto a = dequantize_args(codes, scales, chunk_size, codes.defined() ? codes.numel() : 0, false,
                           "dequantize_int8");
  const int8_t* q = a.codes.const_data_ptr<int8_t>();
  const float* s = a.scales.const_data_ptr<float>();
  float* out = a.out.mutable_data_ptr<float>();
  const int64_t n = a.out.numel();
  // per chunk, its scale hoisted: a loop the compiler vectorises
  at::parallel_for(0, a.scales.numel(), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const float scale = s[c];
      const int64_t end = std::min(n, (c + 1) * chunk_size);
      for (int64_t i = c * chunk_size; i < end; ++i) out[i] = static_cast<float>(q[i]) * scale;
    }
  });
  return a.out;
}

at::Tensor dequantize_1bit_cpu(const at::Tensor& bits, const at::Tensor& scales, int64_t chunk_size,
                               int64_t numel) {
  auto a = dequantize_args(bits, scales, chunk_size, numel, true, "dequantize_1bit");
  const uint8_t* b = a.codes.const_data_ptr<uint8_t>();
  const float* s = a.scales.const_data_ptr<float>();
  float* out = a.out.mutable_data_ptr<float>();
  // A byte's eight signs as eight +-1 floats (a 8 KiB table): a byte becomes one table load
  // and one multiply by the chunk's scale, instead of eight bit tests.
  static const auto signs = [] {
    std::array<std::array<float, 8>, 256> t{};
    for (int byte = 0; byte < 256; ++byte) {
      for (int k = 0; k < 8; ++k) {
        t[byte][k] = (byte >> k) & 1 ? 1.f : -1.f;
      }
    }
    return t;
  }();
  using Vec = at::vec::Vectorized<float>;
  // per chunk (whole bytes: chunk_size % 8 == 0), its scale hoisted
  at::parallel_for(0, a.scales.numel(), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const float scale = s[c];
      const int64_t begin = c * chunk_size;
      const int64_t end = std::min(numel, begin + chunk_size);
      const int64_t whole = begin + (end - begin) / 8 * 8;  // elements in whole bytes
      for (int64_t i = begin; i < whole; i += 8) {
        const float* eight = signs[b[i >> 3]].data();
        if constexpr (Vec::size() == 8) {
          (Vec::loadu(eight) * Vec(scale)).store(out + i);
        } else {
          for (int k = 0; k < 8; ++k) {
            out[i + k] = eight[k] * scale;
          }
        }
      }
      for (int64_t i = whole; i < end; ++i) {
        out[i] = (b[i >> 3] >> (i & 7)) & 1 ? scale : -scale;
      }
    }
  });
  return a.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("quantize_int8_ef", &quantize_int8_ef_cpu);
  m.impl("dequantize_int8", &dequantize_int8_cpu);
  m.impl("quantize_1bit_ef", &quantize_1bit_ef_cpu);
  m.impl("dequantize_1bit", &dequantize_1bit_cpu);
}

// No derivative: these run on gradients, below autograd.
TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("quantize_int8_ef", torch::autograd::autogradNotImplementedFallback());
  m.impl("dequantize_int8", torch::autograd::autogradNotImplementedFallback());
  m.impl("quantize_1bit_ef", torch::autograd::autogradNotImplementedFallback());
  m.impl("dequantize_1bit", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace tp_ext::ops
