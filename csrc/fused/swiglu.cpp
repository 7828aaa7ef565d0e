// SwiGLU on a merged gate/up projection, CPU kernels and C++ autograd.
//
//   swiglu(gate_up [..., 2I]) = silu(gate) * up   [..., I], gate = gate_up[..., :I], up = [..., I:]
//   swiglu_backward(grad [..., I], gate_up) -> grad_gate_up [..., 2I]
// Math in fp32; silu(gate) is rounded to the input dtype before the product, as
// F.silu(gate) * up does in bf16/fp16, so results match the unfused PyTorch code.
#include "fused.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#ifdef TP_EXT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>  // at::cuda::getCurrentCUDAStream is this function
#endif

#include <cmath>
#include <utility>
#include <vector>

namespace tp_ext::fused {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

void check_gate_up(const at::Tensor& gate_up, const char* op) {
  TORCH_CHECK_VALUE(gate_up.defined() && gate_up.layout() == at::kStrided, "tp_ext.", op,
                    ": gate_up must be a dense (strided) tensor.");
  TORCH_CHECK_VALUE(at::isFloatingType(gate_up.scalar_type()), "tp_ext.", op,
                    ": gate_up must be floating point, got ", gate_up.scalar_type(), ".");
  TORCH_CHECK_VALUE(gate_up.dim() >= 1 && gate_up.sym_size(-1) % 2 == 0, "tp_ext.", op,
                    ": gate_up has shape ", gate_up.sym_sizes(),
                    "; its last dimension must be even (gate and up stacked: [..., 2 * I]).");
}

std::vector<int64_t> half_shape(const at::Tensor& gate_up) {
  auto shape = gate_up.sizes().vec();
  shape.back() /= 2;
  return shape;
}

// Checked, contiguous (gate_up, grad) for swiglu_backward on any device.
std::pair<at::Tensor, at::Tensor> backward_inputs(const at::Tensor& grad_in,
                                                  const at::Tensor& gate_up_in) {
  const char* op = "swiglu_backward";
  check_gate_up(gate_up_in, op);
  auto gu = gate_up_in.contiguous();
  const auto shape = half_shape(gu);
  TORCH_CHECK_VALUE(grad_in.sizes().equals(shape), "tp_ext.", op, ": grad has shape ",
                    grad_in.sizes(), " but gate_up has shape ", gu.sizes(),
                    "; grad must have shape ", at::IntArrayRef(shape), ".");
  return {gu, grad_in.to(gu.scalar_type()).contiguous()};
}

int64_t grain(int64_t i) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(i, 1)); }

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// silu(v) = v / (1 + exp(-v)) over a fp32 row, rounded through T.
template <typename T>
inline void silu_row(const float* v, float* out, int64_t n) {
  int64_t j = 0;
  const Vec one(1.f);
  for (; j + kVec <= n; j += kVec) {
    const Vec x = Vec::loadu(v + j);
    (x / (one + x.neg().exp())).store(out + j);
  }
  for (; j < n; ++j) out[j] = v[j] / (1.f + std::exp(-v[j]));
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>)
    for (j = 0; j < n; ++j) out[j] = round_to<T>(out[j]);
}

at::Tensor swiglu_cpu(const at::Tensor& gate_up_in) {
  check_gate_up(gate_up_in, "swiglu");
  const auto gu = gate_up_in.contiguous();
  auto out = at::empty(half_shape(gu), gu.options());
  const int64_t inter = out.size(-1), n = inter == 0 ? 0 : out.numel() / inter;
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "swiglu", [&] {
    const scalar_t* in = gu.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(inter), [&](int64_t begin, int64_t end) {
      std::vector<float> g(inter), u(inter), s(inter);
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* row = in + i * 2 * inter;
        for (int64_t j = 0; j < inter; ++j) g[j] = static_cast<float>(row[j]);
        for (int64_t j = 0; j < inter; ++j) u[j] = static_cast<float>(row[inter + j]);
        silu_row<scalar_t>(g.data(), s.data(), inter);
        int64_t j = 0;
        for (; j + kVec <= inter; j += kVec)
          (Vec::loadu(s.data() + j) * Vec::loadu(u.data() + j)).store(s.data() + j);
        for (; j < inter; ++j) s[j] *= u[j];
        for (j = 0; j < inter; ++j) o[i * inter + j] = static_cast<scalar_t>(s[j]);
      }
    });
  });
  return out;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad_in, const at::Tensor& gate_up_in) {
  const auto inputs = backward_inputs(grad_in, gate_up_in);
  const at::Tensor& gu = inputs.first;
  const at::Tensor& grad = inputs.second;
  const auto shape = half_shape(gu);
  auto out = at::empty(gu.sizes(), gu.options());
  const int64_t inter = shape.back(), n = inter == 0 ? 0 : grad.numel() / inter;
  if (grad.numel() == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "swiglu_backward", [&] {
    const scalar_t* in = gu.const_data_ptr<scalar_t>();
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(inter), [&](int64_t begin, int64_t end) {
      std::vector<float> g(inter), s(inter);
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* row = in + i * 2 * inter;
        const scalar_t* gr = gp + i * inter;
        scalar_t* orow = o + i * 2 * inter;
        for (int64_t j = 0; j < inter; ++j) g[j] = static_cast<float>(row[j]);
        silu_row<scalar_t>(g.data(), s.data(), inter);
        for (int64_t j = 0; j < inter; ++j) {
          const float gj = g[j], dy = static_cast<float>(gr[j]);
          const float up = static_cast<float>(row[inter + j]);
          const float sig = 1.f / (1.f + std::exp(-gj));
          // d silu / d g = sig * (1 + g * (1 - sig)); grad of silu rounded as the reference's mul
          const float dsilu = round_to<scalar_t>(dy * up);
          orow[j] = static_cast<scalar_t>(dsilu * sig * (1.f + gj * (1.f - sig)));
          orow[inter + j] = static_cast<scalar_t>(dy * s[j]);
        }
      }
    });
  });
  return out;
}

#ifdef TP_EXT_WITH_CUDA
at::Tensor swiglu_cuda(const at::Tensor& gate_up_in) {
  check_gate_up(gate_up_in, "swiglu");
  const auto gu = gate_up_in.contiguous();
  auto out = at::empty(half_shape(gu), gu.options());
  if (out.numel() > 0) swiglu_cuda_launch(gu, out, c10::cuda::getCurrentCUDAStream().stream());
  return out;
}

at::Tensor swiglu_backward_cuda(const at::Tensor& grad_in, const at::Tensor& gate_up_in) {
  const auto inputs = backward_inputs(grad_in, gate_up_in);
  const at::Tensor& gu = inputs.first;
  const at::Tensor& grad = inputs.second;
  auto out = at::empty(gu.sizes(), gu.options());
  if (grad.numel() == 0) return out.zero_();
  swiglu_backward_cuda_launch(grad, gu, out, c10::cuda::getCurrentCUDAStream().stream());
  return out;
}
#endif

class SwigluFn : public torch::autograd::Function<SwigluFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto handle = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tp_ext::swiglu", "")
                             .typed<at::Tensor(const at::Tensor&)>();
    ctx->save_for_backward({gate_up});
    return handle.call(gate_up);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto handle = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tp_ext::swiglu_backward", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    if (!grads[0].defined()) return {at::Tensor()};
    return {handle.call(grads[0], ctx->get_saved_variables()[0])};
  }
};

at::Tensor swiglu_autograd(const at::Tensor& gate_up) { return SwigluFn::apply(gate_up); }

}  // namespace
}  // namespace tp_ext::fused

TORCH_LIBRARY_FRAGMENT(tp_ext, m) {
  // ---- fused activation (csrc/fused/swiglu.cpp) ----
  m.def("swiglu(Tensor gate_up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("swiglu", &tp_ext::fused::swiglu_cpu);
  m.impl("swiglu_backward", &tp_ext::fused::swiglu_backward_cpu);
}

#ifdef TP_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) {
  m.impl("swiglu", &tp_ext::fused::swiglu_cuda);
  m.impl("swiglu_backward", &tp_ext::fused::swiglu_backward_cuda);
}
#endif

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("swiglu", &tp_ext::fused::swiglu_autograd);
  m.impl("swiglu_backward", torch::autograd::autogradNotImplementedFallback());
}
