// RMSNorm and residual-add + RMSNorm (Hugging Face semantics): the shared argument setup, the CPU
// kernels and the C++ autograd (CUDA kernels: rms_norm_cuda.cu).
//
//   rms_norm(x, w, eps)            = w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
//   add_rms_norm(x, r, w, eps)     = (rms_norm(h, w, eps), h) with h = x + r in x's dtype
//   rms_norm_backward(g, x, w, eps) -> (grad_x, grad_weight), rstd recomputed (cheaper than an
//                                      extra saved output, and keeps the forward schema plain)
// Output dtype is torch's promotion of x and weight, as in the reference. Rows are independent:
// parallel over rows, each row converted to fp32 once and processed with Vectorized<float>.
#include "rms_norm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../common/dispatch.h"

namespace tp_ext::ops {

at::ScalarType check_rms_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK_VALUE(x.defined() && weight.defined(), "tp_ext.", op, ": undefined tensor argument.");
  TORCH_CHECK_VALUE(x.layout() == at::kStrided && weight.layout() == at::kStrided, "tp_ext.", op,
                    ": x and weight must be dense (strided) tensors.");
  TORCH_CHECK_VALUE(at::isFloatingType(x.scalar_type()) && at::isFloatingType(weight.scalar_type()),
                    "tp_ext.", op, ": x and weight must be floating point, got ", x.scalar_type(),
                    " and ", weight.scalar_type(), ".");
  TORCH_CHECK_VALUE(x.dim() >= 1, "tp_ext.", op,
                    ": x must have a hidden (last) dimension, got a 0-d tensor.");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.sym_size(0) == x.sym_size(-1), "tp_ext.", op,
                    ": weight has shape ", weight.sym_sizes(), " but x has shape ", x.sym_sizes(),
                    "; weight must have shape [x.shape[-1]] = [", x.sym_size(-1), "].");
  TORCH_CHECK_VALUE(weight.device() == x.device(), "tp_ext.", op, ": weight is on ",
                    weight.device(), " but x is on ", x.device(), ".");
  return at::promote_types(x.scalar_type(), weight.scalar_type());
}

void check_residual(const at::Tensor& x, const at::Tensor& residual) {
  TORCH_CHECK_VALUE(residual.defined() && residual.sym_sizes().equals(x.sym_sizes()) &&
                        residual.scalar_type() == x.scalar_type() &&
                        residual.device() == x.device(),
                    "tp_ext.add_rms_norm: residual (shape ", residual.sym_sizes(), ", ",
                    residual.scalar_type(), ") must match x (shape ", x.sym_sizes(), ", ",
                    x.scalar_type(), ") in shape, dtype and device.");
}

RmsNormArgs rms_norm_args(const at::Tensor& x_in, const at::Tensor* res_in,
                          const at::Tensor& weight, const char* op) {
  RmsNormArgs a;
  a.out_dtype = check_rms_args(x_in, weight, op);
  a.x = x_in.contiguous();
  a.w = weight.to(at::kFloat).contiguous();
  if (res_in) {
    a.res = res_in->contiguous();
    a.h = at::empty(a.x.sizes(), a.x.options());
  }
  a.out = at::empty(a.x.sizes(), a.x.options().dtype(a.out_dtype));
  return a;
}

RmsNormBackwardArgs rms_norm_backward_args(const at::Tensor& grad_in, const at::Tensor& x_in,
                                           const at::Tensor& weight, bool float_grad) {
  const char* op = "rms_norm_backward";
  check_rms_args(x_in, weight, op);
  TORCH_CHECK_VALUE(grad_in.sym_sizes().equals(x_in.sym_sizes()), "tp_ext.", op,
                    ": grad has shape ", grad_in.sym_sizes(), " but x has shape ", x_in.sym_sizes(),
                    ".");
  return {x_in.contiguous(), (float_grad ? grad_in.to(at::kFloat) : grad_in).contiguous(),
          weight.to(at::kFloat).contiguous()};
}

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

int64_t rows_of(const at::Tensor& x) {
  int64_t n = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) n *= x.size(d);
  return n;
}

int64_t grain(int64_t h) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(h, 1)); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<T>(src[j]);
}

// Rounds through T, as the reference's `.to(x.dtype)` does between the fp32 math and the weight.
template <typename T>
inline void round_row(float* v, int64_t n) {
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>)
    for (int64_t j = 0; j < n; ++j) v[j] = static_cast<float>(static_cast<T>(v[j]));
}

inline float hsum(const Vec& v) {
  float buf[kVec];
  v.store(buf);
  float s = 0.f;
  for (int64_t k = 0; k < kVec; ++k) s += buf[k];
  return s;
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
  float s = hsum(acc);
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

inline float rstd_of(const float* v, int64_t n, double eps) {
  return 1.f / std::sqrt(dot(v, v, n) / static_cast<float>(n) + static_cast<float>(eps));
}

// out = a * b (elementwise, fp32)
inline void mul_rows(const float* a, const float* b, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + kVec <= n; j += kVec) (Vec::loadu(a + j) * Vec::loadu(b + j)).store(out + j);
  for (; j < n; ++j) out[j] = a[j] * b[j];
}

inline void scale_row(const float* a, float s, float* out, int64_t n) {
  int64_t j = 0;
  const Vec sv(s);
  for (; j + kVec <= n; j += kVec) (Vec::loadu(a + j) * sv).store(out + j);
  for (; j < n; ++j) out[j] = a[j] * s;
}

template <typename T, typename O>
void forward_rows(const T* x, const T* res, const float* w, double eps, int64_t n, int64_t hdim,
                  O* out, T* h) {
  at::parallel_for(0, n, grain(hdim), [&](int64_t begin, int64_t end) {
    std::vector<float> v(hdim), tmp(hdim), rv(res ? hdim : 0);
    for (int64_t i = begin; i < end; ++i) {
      load_row(x + i * hdim, v.data(), hdim);
      if (res) {  // h = x + residual, rounded to x's dtype (the reference adds in that dtype)
        load_row(res + i * hdim, rv.data(), hdim);
        int64_t j = 0;
        for (; j + kVec <= hdim; j += kVec)
          (Vec::loadu(v.data() + j) + Vec::loadu(rv.data() + j)).store(v.data() + j);
        for (; j < hdim; ++j) v[j] += rv[j];
        store_row(v.data(), h + i * hdim, hdim);
        round_row<T>(v.data(), hdim);
      }
      scale_row(v.data(), rstd_of(v.data(), hdim, eps), tmp.data(), hdim);
      round_row<T>(tmp.data(), hdim);
      mul_rows(tmp.data(), w, tmp.data(), hdim);
      store_row(tmp.data(), out + i * hdim, hdim);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& x_in, const at::Tensor* res_in,
                                               const at::Tensor& weight, double eps,
                                               const char* op) {
  const auto a = rms_norm_args(x_in, res_in, weight, op);
  const at::Tensor &x = a.x, &w = a.w, &res = a.res, &h = a.h, &out = a.out;
  const auto out_dtype = a.out_dtype;
  const int64_t hdim = x.size(-1), n = rows_of(x);
  if (n == 0 || hdim == 0) return {out, h};
  TP_EXT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* rp = res_in ? res.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* hp = res_in ? h.data_ptr<scalar_t>() : nullptr;
    if (out_dtype == x.scalar_type()) {
      forward_rows<scalar_t, scalar_t>(x.const_data_ptr<scalar_t>(), rp, w.const_data_ptr<float>(),
                                       eps, n, hdim, out.data_ptr<scalar_t>(), hp);
    } else if (out_dtype == at::kFloat) {
      forward_rows<scalar_t, float>(x.const_data_ptr<scalar_t>(), rp, w.const_data_ptr<float>(),
                                    eps, n, hdim, out.data_ptr<float>(), hp);
    } else {
      TORCH_CHECK(out_dtype == at::kDouble);
      forward_rows<scalar_t, double>(x.const_data_ptr<scalar_t>(), rp, w.const_data_ptr<float>(),
                                     eps, n, hdim, out.data_ptr<double>(), hp);
    }
  });
  return {out, h};
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(forward_cpu(x, nullptr, weight, eps, "rms_norm"));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps) {
  check_rms_args(x, weight, "add_rms_norm");
  check_residual(x, residual);
  return forward_cpu(x, &residual, weight, eps, "add_rms_norm");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_in,
                                                         const at::Tensor& x_in,
                                                         const at::Tensor& weight, double eps) {
  const auto in = rms_norm_backward_args(grad_in, x_in, weight);
  const at::Tensor &x = in.x, &g = in.grad, &w = in.weight;
  auto grad_x = at::empty(x.sizes(), x.options());
  const int64_t hdim = x.size(-1), n = rows_of(x);
  // Weight gradient: fp32 partial sums per chunk of rows, reduced at the end (deterministic).
  const int64_t chunks = std::min<int64_t>(n, std::max<int64_t>(1, at::get_num_threads()));
  auto partial = at::zeros({chunks, hdim}, x.options().dtype(at::kFloat));
  if (n > 0 && hdim > 0) {
    TP_EXT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_backward", [&] {
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      const float* gp = g.const_data_ptr<float>();
      const float* wp = w.const_data_ptr<float>();
      scalar_t* gx = grad_x.data_ptr<scalar_t>();
      float* pp = partial.data_ptr<float>();
      at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
        std::vector<float> v(hdim), dn(hdim), tmp(hdim);
        for (int64_t c = cb; c < ce; ++c) {
          float* dw = pp + c * hdim;
          for (int64_t i = c * n / chunks; i < (c + 1) * n / chunks; ++i) {
            load_row(xp + i * hdim, v.data(), hdim);
            const float* gi = gp + i * hdim;
            const float rstd = rstd_of(v.data(), hdim, eps);
            // dw += g * normed (normed rounded through x's dtype, as in the forward)
            scale_row(v.data(), rstd, tmp.data(), hdim);
            round_row<scalar_t>(tmp.data(), hdim);
            int64_t j = 0;
            for (; j + kVec <= hdim; j += kVec)
              at::vec::fmadd(Vec::loadu(gi + j), Vec::loadu(tmp.data() + j), Vec::loadu(dw + j))
                  .store(dw + j);
            for (; j < hdim; ++j) dw[j] += gi[j] * tmp[j];
            // dx = rstd * dn - x * rstd^3 * mean(dn * x), dn = g * w
            mul_rows(gi, wp, dn.data(), hdim);
            const float c3 =
                rstd * rstd * rstd * dot(dn.data(), v.data(), hdim) / static_cast<float>(hdim);
            const Vec rv(rstd), cv(c3);
            j = 0;
            for (; j + kVec <= hdim; j += kVec)
              (Vec::loadu(dn.data() + j) * rv - Vec::loadu(v.data() + j) * cv)
                  .store(tmp.data() + j);
            for (; j < hdim; ++j) tmp[j] = dn[j] * rstd - v[j] * c3;
            store_row(tmp.data(), gx + i * hdim, hdim);
          }
        }
      });
    });
  }
  return {grad_x, partial.sum(0).to(weight.scalar_type())};
}

using BwdSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, double);

std::tuple<at::Tensor, at::Tensor> call_backward(const at::Tensor& grad, const at::Tensor& x,
                                                 const at::Tensor& w, double eps) {
  static auto handle = op_handle("rms_norm_backward").typed<BwdSig>();
  return handle.call(grad, x, w, eps);
}

class RmsNormFn : public torch::autograd::Function<RmsNormFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto handle =
        op_handle("rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    return handle.call(x, weight, eps);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    auto [gx, gw] = call_backward(grads[0], saved[0], saved[1], ctx->saved_data["eps"].toDouble());
    return {gx, gw, at::Tensor()};
  }
};

class AddRmsNormFn : public torch::autograd::Function<AddRmsNormFn> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto handle =
        op_handle("add_rms_norm")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, double)>();
    auto [out, h] = handle.call(x, residual, weight, eps);
    ctx->save_for_backward({h, weight});
    ctx->saved_data["eps"] = eps;
    return {out, h};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor gh = grads[1], gw;
    if (grads[0].defined()) {
      auto [gx, gw_] =
          call_backward(grads[0], saved[0], saved[1], ctx->saved_data["eps"].toDouble());
      gh = gh.defined() ? gx + gh : gx;
      gw = gw_;
    }
    // h = x + residual: both get dL/dh.
    return {gh, gh, gw, at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFn::apply(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_autograd(const at::Tensor& x,
                                                         const at::Tensor& residual,
                                                         const at::Tensor& weight, double eps) {
  auto outs = AddRmsNormFn::apply(x, residual, weight, eps);
  return {outs[0], outs[1]};
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) {
  m.impl("rms_norm", &tp_ext::ops::rms_norm_cpu);
  m.impl("add_rms_norm", &tp_ext::ops::add_rms_norm_cpu);
  m.impl("rms_norm_backward", &tp_ext::ops::rms_norm_backward_cpu);
}

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("rms_norm", &tp_ext::ops::rms_norm_autograd);
  m.impl("add_rms_norm", &tp_ext::ops::add_rms_norm_autograd);
  // No double backward.
  m.impl("rms_norm_backward", torch::autograd::autogradNotImplementedFallback());
}
