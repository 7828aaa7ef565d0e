// SwiGLU on a merged gate/up projection: the shared argument setup, the CPU kernels and the C++
// autograd (CUDA kernels: swiglu_cuda.cu).
//
//   swiglu(gate_up [..., 2I]) = silu(gate) * up   [..., I], gate = gate_up[..., :I], up = [..., I:]
//   swiglu_backward(grad [..., I], gate_up) -> grad_gate_up [..., 2I]
// Math in fp32 (double for double), rounded to the input dtype once at the end. The unfused
// bf16/fp16 code also rounds silu(gate) and grad * up on the way, so this is at least as accurate
// (tests/test_fused_kernels.py: test_swiglu_rounds_once).
#include "swiglu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cmath>
#include <utility>
#include <vector>

#include "../common/dispatch.h"

namespace tp_ext::ops {

void check_gate_up(const at::Tensor& gate_up, const char* op) {
  TORCH_CHECK_VALUE(gate_up.defined() && gate_up.layout() == at::kStrided, "tp_ext.", op,
                    ": gate_up must be a dense (strided) tensor.");
  TORCH_CHECK_VALUE(at::isFloatingType(gate_up.scalar_type()), "tp_ext.", op,
                    ": gate_up must be floating point, got ", gate_up.scalar_type(), ".");
  TORCH_CHECK_VALUE(gate_up.dim() >= 1 && gate_up.sym_size(-1) % 2 == 0, "tp_ext.", op,
                    ": gate_up has shape ", gate_up.sym_sizes(),
                    "; its last dimension must be even (gate and up stacked: [..., 2 * I]).");
}

std::vector<int64_t> swiglu_out_shape(const at::Tensor& gate_up) {
  auto shape = gate_up.sizes().vec();
  shape.back() /= 2;
  return shape;
}

SwigluBackwardArgs swiglu_backward_args(const at::Tensor& grad_in, const at::Tensor& gate_up_in) {
  const char* op = "swiglu_backward";
  check_gate_up(gate_up_in, op);
  auto gu = gate_up_in.contiguous();
  const auto shape = swiglu_out_shape(gu);
  TORCH_CHECK_VALUE(grad_in.sizes().equals(shape), "tp_ext.", op, ": grad has shape ",
                    grad_in.sizes(), " but gate_up has shape ", gu.sizes(),
                    "; grad must have shape ", at::IntArrayRef(shape), ".");
  auto grad = grad_in.to(gu.scalar_type()).contiguous();
  auto out =
      grad.numel() == 0 ? at::zeros(gu.sizes(), gu.options()) : at::empty(gu.sizes(), gu.options());
  return {gu, grad, out};
}

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

int64_t grain(int64_t i) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(i, 1)); }

template <typename T>
constexpr bool kReduced = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

// exp(-|g|), in (0, 1]: it cannot overflow, whatever g is. Under AVX-512: e^x = 2^n e^r with
// n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 in two parts, so r is exact to
// fp32), a Taylor polynomial for e^r and scalef for the 2^n part. Degree 7 for fp32 (truncation
// error 5e-9, a tenth of an ulp) and degree 5 for bf16/fp16 (2.4e-6; their results keep 8 or 11
// bits). That is half of SLEEF's instructions, and the exp was most of the kernel's time.
// Elsewhere SLEEF's exp (fp32) or ATen's exp_u20 (bf16/fp16).
template <typename T>
inline Vec exp_neg_abs(const Vec& g) {
#if defined(CPU_CAPABILITY_AVX512)
  // x = -|g|, floored where e^x is zero in fp32 anyway.
  const __m512 x =
      _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)), _mm512_set1_ps(-110.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2, high bits (exact)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      // ln 2, the rest
  // 1 / k!, highest degree first
  __m512 p;
  if constexpr (kReduced<T>) {
    p = _mm512_set1_ps(1.f / 120);
  } else {
    p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  }
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
#else
  if constexpr (kReduced<T>) return g.abs().neg().exp_u20();
  return g.abs().neg().exp();
#endif
}

// 1 / d for d in [1, 2]. Under AVX-512 the 14-bit hardware estimate refined by one Newton step
// (relative error about 2^-27) replaces the slower division.
inline Vec reciprocal_1_2(const Vec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
#else
  return Vec(1.f) / d;
#endif
}

// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|): no overflow, so a
// large negative g gives 0 (and silu(g) = -0), not inf / inf.
template <typename T>
inline Vec sigmoid_vec(const Vec& g) {
  const Vec e = exp_neg_abs<T>(g);
  const Vec r = reciprocal_1_2(Vec(1.f) + e);
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_mul_ps(r, negative, e, r);
#else
  return Vec::blendv(r, e * r, g < Vec(0.f));
#endif
}

// Forward on kVec fp32 lanes: silu(g) * u, rounded once by the store.
template <typename T>
inline Vec swiglu_vec(const Vec& g, const Vec& u) {
  return g * sigmoid_vec<T>(g) * u;
}

// Backward on kVec fp32 lanes: (d gate, d up) = (dy u s (1 + g (1 - s)), dy g s), s = sigmoid(g).
template <typename T>
inline std::pair<Vec, Vec> swiglu_grad_vec(const Vec& g, const Vec& u, const Vec& dy) {
  const Vec one(1.f);
  const Vec sig = sigmoid_vec<T>(g);
  return {dy * u * sig * (one + g * (one - sig)), dy * g * sig};
}

// The same on one element, for the tails and for double (in double).
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Loads/stores kVec fp32 lanes (float) or 2 x kVec lanes (bf16/fp16, widened to fp32).
template <typename T>
struct Lanes {
  static constexpr int64_t width = kReduced<T> ? 2 * kVec : kVec;
  static std::pair<Vec, Vec> load(const T* p) {
    if constexpr (kReduced<T>) {
      auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
      return {lo, hi};
    } else {
      return {Vec::loadu(p), Vec(0.f)};
    }
  }
  static void store(T* p, const Vec& lo, const Vec& hi) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      // One round-to-nearest-even instruction for 32 lanes (fp32 subnormals, below 1.2e-38,
      // become zero; NaN stays NaN) instead of ATen's integer rounding and packing.
      _mm512_storeu_si512(p, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
      return;
    }
#endif
    if constexpr (kReduced<T>) {
      at::vec::convert_from_float<T>(lo, hi).store(p);
    } else {
      lo.store(p);
    }
  }
};

template <typename T>
void swiglu_rows(const T* in, T* out, int64_t begin, int64_t end, int64_t inter) {
  for (int64_t i = begin; i < end; ++i) {
    const T* gate = in + i * 2 * inter;
    const T* up = gate + inter;
    T* o = out + i * inter;
    int64_t j = 0;
    if constexpr (!std::is_same_v<T, double>) {
      using L = Lanes<T>;
      for (; j + L::width <= inter; j += L::width) {
        const auto [g0, g1] = L::load(gate + j);
        const auto [u0, u1] = L::load(up + j);
        L::store(o + j, swiglu_vec<T>(g0, u0), kReduced<T> ? swiglu_vec<T>(g1, u1) : Vec(0.f));
      }
    }
    for (; j < inter; ++j) {
      const Acc<T> g = static_cast<Acc<T>>(gate[j]);
      o[j] = static_cast<T>(g / (1 + std::exp(-g)) * static_cast<Acc<T>>(up[j]));
    }
  }
}

template <typename T>
void swiglu_grad_rows(const T* in, const T* grad, T* out, int64_t begin, int64_t end,
                      int64_t inter) {
  for (int64_t i = begin; i < end; ++i) {
    const T* gate = in + i * 2 * inter;
    const T* up = gate + inter;
    const T* dy = grad + i * inter;
    T* dgate = out + i * 2 * inter;
    T* dup = dgate + inter;
    int64_t j = 0;
    if constexpr (!std::is_same_v<T, double>) {
      using L = Lanes<T>;
      for (; j + L::width <= inter; j += L::width) {
        const auto [g0, g1] = L::load(gate + j);
        const auto [u0, u1] = L::load(up + j);
        const auto [d0, d1] = L::load(dy + j);
        const auto lo = swiglu_grad_vec<T>(g0, u0, d0);
        const auto hi = kReduced<T> ? swiglu_grad_vec<T>(g1, u1, d1) : lo;
        L::store(dgate + j, lo.first, hi.first);
        L::store(dup + j, lo.second, hi.second);
      }
    }
    for (; j < inter; ++j) {
      const Acc<T> g = static_cast<Acc<T>>(gate[j]), d = static_cast<Acc<T>>(dy[j]);
      const Acc<T> u = static_cast<Acc<T>>(up[j]);
      const Acc<T> sig = 1 / (1 + std::exp(-g));
      dgate[j] = static_cast<T>(d * u * sig * (1 + g * (1 - sig)));
      dup[j] = static_cast<T>(d * g * sig);
    }
  }
}

at::Tensor swiglu_cpu(const at::Tensor& gate_up_in) {
  check_gate_up(gate_up_in, "swiglu");
  const auto gu = gate_up_in.contiguous();
  auto out = at::empty(swiglu_out_shape(gu), gu.options());
  const int64_t inter = out.size(-1), n = inter == 0 ? 0 : out.numel() / inter;
  if (out.numel() == 0) return out;
  TP_EXT_DISPATCH_FLOATING_TYPES(gu.scalar_type(), "swiglu", [&] {
    const scalar_t* in = gu.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(inter), [&](int64_t begin, int64_t end) {
      swiglu_rows<scalar_t>(in, o, begin, end, inter);
    });
  });
  return out;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad_in, const at::Tensor& gate_up_in) {
  const auto a = swiglu_backward_args(grad_in, gate_up_in);
  const int64_t inter = a.gate_up.size(-1) / 2;
  if (a.grad.numel() == 0) return a.out;
  const int64_t n = a.grad.numel() / inter;
  TP_EXT_DISPATCH_FLOATING_TYPES(a.gate_up.scalar_type(), "swiglu_backward", [&] {
    const scalar_t* in = a.gate_up.const_data_ptr<scalar_t>();
    const scalar_t* gp = a.grad.const_data_ptr<scalar_t>();
    scalar_t* o = a.out.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain(inter), [&](int64_t begin, int64_t end) {
      swiglu_grad_rows<scalar_t>(in, gp, o, begin, end, inter);
    });
  });
  return a.out;
}

class SwigluFn : public torch::autograd::Function<SwigluFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto handle = op_handle("swiglu").typed<at::Tensor(const at::Tensor&)>();
    ctx->save_for_backward({gate_up});
    return handle.call(gate_up);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto handle =
        op_handle("swiglu_backward").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    if (!grads[0].defined()) return {at::Tensor()};
    return {handle.call(grads[0], ctx->get_saved_variables()[0])};
  }
};

at::Tensor swiglu_autograd(const at::Tensor& gate_up) { return SwigluFn::apply(gate_up); }

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("swiglu", &tp_ext::ops::swiglu_cpu);
  m.impl("swiglu_backward", &tp_ext::ops::swiglu_backward_cpu);
}

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("swiglu", &tp_ext::ops::swiglu_autograd);
  m.impl("swiglu_backward", torch::autograd::autogradNotImplementedFallback());
}
