// tp_ext::rotary_embedding: Hugging Face's half-rotation RoPE applied to q and k in one op.
//
// With h = D / 2, x = (a, b) the halves of a head vector and c, s the cos/sin rows:
//   y = x * c + rotate_half(x) * s,   rotate_half(a, b) = (-b, a)
//   i.e. y_lo = a c_lo - b s_lo,  y_hi = b c_hi + a s_hi.
// Its transpose (the input gradient) is
//   dx_lo = g_lo c_lo + g_hi s_hi,  dx_hi = g_hi c_hi - g_lo s_lo,
// which is the same rotation with sin' = -(s_hi, s_lo) (halves swapped, negated); so the
// backward reuses the op itself and stays differentiable (double backward works).
//
// q [B, Hq, S, D] and k [B, Hk, S, D] may differ in head count (GQA) and be strided views (the
// attention layer passes [B, S, H, D] storage transposed); cos/sin [B, S, D] broadcast over
// heads. Math in fp32 (fp64 for fp64).
#include "rotary_embedding.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "../common/dispatch.h"

namespace tp_ext::ops {

void check_rotary_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                       const at::Tensor& sin) {
  const char* op = "tp_ext.rotary_embedding: ";
  TORCH_CHECK_VALUE(q.dim() == 4, op, "q must be [batch, heads, seq, head_dim], got shape ",
                    q.sym_sizes(), ".");
  TORCH_CHECK_VALUE(k.dim() == 4, op, "k must be [batch, kv_heads, seq, head_dim], got shape ",
                    k.sym_sizes(), ".");
  const auto& d = q.sym_size(3);
  TORCH_CHECK_VALUE(d % 2 == 0, op, "head_dim must be even, got q of shape ", q.sym_sizes(),
                    " (head_dim ", d, ").");
  TORCH_CHECK_VALUE(
      k.sym_size(0) == q.sym_size(0) && k.sym_size(2) == q.sym_size(2) && k.sym_size(3) == d, op,
      "k of shape ", k.sym_sizes(), " does not match q of shape ", q.sym_sizes(),
      " in batch, seq or head_dim (only the head count may differ).");
  const c10::SymInt want[3] = {q.sym_size(0), q.sym_size(2), d};
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"cos", cos},
                                std::pair<const char*, const at::Tensor&>{"sin", sin}}) {
    TORCH_CHECK_VALUE(t.sym_sizes().equals(c10::SymIntArrayRef(want, 3)), op, name, " has shape ",
                      t.sym_sizes(), " but q has shape ", q.sym_sizes(), "; ", name,
                      " must be [batch, seq, head_dim] = [", want[0], ", ", want[1], ", ", want[2],
                      "].");
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"k", k},
                                std::pair<const char*, const at::Tensor&>{"cos", cos},
                                std::pair<const char*, const at::Tensor&>{"sin", sin}}) {
    TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type(), op, name, " has dtype ", t.scalar_type(),
                      " but q has dtype ", q.scalar_type(), "; pass all four in one dtype.");
    TORCH_CHECK_VALUE(t.device() == q.device(), op, name, " is on ", t.device(), " but q is on ",
                      q.device(), ".");
  }
  TORCH_CHECK_VALUE(at::isFloatingType(q.scalar_type()), op, "q must be floating point, got ",
                    q.scalar_type(), ".");
}

at::Tensor rotary_out_like(const at::Tensor& x) {
  auto out = at::empty_like(x, at::MemoryFormat::Preserve);
  // The kernels write head_dim with unit stride; other dense layouts get a contiguous output.
  return out.stride(3) == 1 ? out : at::empty(x.sizes(), x.options());
}

namespace {

// One tensor's rotation: x and out share strides (out = empty_like(x)); rows are (b, h, s).
template <typename scalar_t>
void rotate_cpu(const at::Tensor& x, at::Tensor& out, const at::Tensor& cos,
                const at::Tensor& sin) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), h = D / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* cp = cos.const_data_ptr<scalar_t>();
  const scalar_t* sp = sin.const_data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t rows = B * H * S;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)),
                   [&](int64_t begin, int64_t end) {
    // Per-chunk fp32 scratch: x halves, cos and sin rows, converted once.
    std::vector<acc_t> buf(6 * h);
    acc_t *a = buf.data(), *b = a + h, *clo = b + h, *chi = clo + h, *slo = chi + h, *shi = slo + h;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t s = r % S, bh = r / S, hh = bh % H, bb = bh / H;
      const scalar_t* xr = xp + bb * xs0 + hh * xs1 + s * xs2;
      const scalar_t* cr = cp + (bb * S + s) * D;
      const scalar_t* sr = sp + (bb * S + s) * D;
      scalar_t* orow = op + bb * os0 + hh * os1 + s * os2;
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        int64_t j = 0;
        for (; j + Vec::size() <= h; j += Vec::size()) {
          const Vec va = Vec::loadu(xr + j), vb = Vec::loadu(xr + h + j);
          (va * Vec::loadu(cr + j) - vb * Vec::loadu(sr + j)).store(orow + j);
          (vb * Vec::loadu(cr + h + j) + va * Vec::loadu(sr + h + j)).store(orow + h + j);
        }
        for (; j < h; ++j) {
          const acc_t va = xr[j], vb = xr[h + j];
          orow[j] = va * cr[j] - vb * sr[j];
          orow[h + j] = vb * cr[h + j] + va * sr[h + j];
        }
      } else {
        // Reduced precision: widen to fp32 into the scratch, rotate vectorised, narrow back.
        at::vec::convert(xr, a, h);
        at::vec::convert(xr + h, b, h);
        at::vec::convert(cr, clo, h);
        at::vec::convert(cr + h, chi, h);
        at::vec::convert(sr, slo, h);
        at::vec::convert(sr + h, shi, h);
        int64_t j = 0;
        for (; j + Vec::size() <= h; j += Vec::size()) {
          const Vec va = Vec::loadu(a + j), vb = Vec::loadu(b + j);
          (va * Vec::loadu(clo + j) - vb * Vec::loadu(slo + j)).store(clo + j);
          (vb * Vec::loadu(chi + j) + va * Vec::loadu(shi + j)).store(chi + j);
        }
        for (; j < h; ++j) {
          const acc_t va = a[j], vb = b[j];
          clo[j] = va * clo[j] - vb * slo[j];
          chi[j] = vb * chi[j] + va * shi[j];
        }
        at::vec::convert(clo, orow, h);
        at::vec::convert(chi, orow + h, h);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                              const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_rotary_args(q_in, k_in, cos_in, sin_in);
  // The kernel needs a unit stride along head_dim; other dims may be strided.
  const auto q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const auto k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const auto cos = cos_in.contiguous(), sin = sin_in.contiguous();
  auto q_out = rotary_out_like(q_in), k_out = rotary_out_like(k_in);
  TP_EXT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "rotary_embedding", [&] {
    rotate_cpu<scalar_t>(q, q_out, cos, sin);
    rotate_cpu<scalar_t>(k, k_out, cos, sin);
  });
  return {q_out, k_out};
}

c10::OperatorHandle rotary_handle() {
  static auto h = op_handle("rotary_embedding");
  return h;
}

using RotarySig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&);

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin) {
    const bool table_grad = cos.requires_grad() || sin.requires_grad();
    ctx->saved_data["table_grad"] = table_grad;
    // q and k are only needed for the (rare) gradient of the tables.
    if (table_grad)
      ctx->save_for_backward({q, k, cos, sin});
    else
      ctx->save_for_backward({at::Tensor(), at::Tensor(), cos, sin});
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [qo, ko] = rotary_handle().typed<RotarySig>().call(q, k, cos, sin);
    return {qo, ko};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &cos = saved[2], &sin = saved[3];
    const int64_t h = cos.size(-1) / 2;
    const auto sin_t = at::cat({sin.narrow(-1, h, h), sin.narrow(-1, 0, h)}, -1).neg();
    at::Tensor dq, dk;
    if (grads[0].defined() && grads[1].defined()) {
      std::tie(dq, dk) = rotary_handle().typed<RotarySig>().call(grads[0], grads[1], cos, sin_t);
    } else if (grads[0].defined()) {
      // Pass q's grad as k too (same batch/seq/head_dim); discard the second result.
      dq = std::get<0>(rotary_handle().typed<RotarySig>().call(grads[0], grads[0], cos, sin_t));
    } else {
      dk = std::get<1>(rotary_handle().typed<RotarySig>().call(grads[1], grads[1], cos, sin_t));
    }
    at::Tensor dcos, dsin;
    if (ctx->saved_data["table_grad"].toBool()) {
      // y = x c + rot(x) s summed over heads: dc = sum_h g x, ds = sum_h g rot(x).
      const auto rot = [h](const at::Tensor& x) {
        return at::cat({x.narrow(-1, h, h).neg(), x.narrow(-1, 0, h)}, -1);
      };
      const auto& q = saved[0];
      const auto& k = saved[1];
      dcos = at::zeros_like(cos);
      dsin = at::zeros_like(sin);
      if (grads[0].defined()) {
        dcos = dcos + (grads[0] * q).sum(1);
        dsin = dsin + (grads[0] * rot(q)).sum(1);
      }
      if (grads[1].defined()) {
        dcos = dcos + (grads[1] * k).sum(1);
        dsin = dsin + (grads[1] * rot(k)).sum(1);
      }
    }
    return {dq, dk, dcos, dsin};
  }
};

std::tuple<at::Tensor, at::Tensor> rotary_autograd(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& cos, const at::Tensor& sin) {
  auto out = RotaryFunction::apply(q, k, cos, sin);
  return {out[0], out[1]};
}

}  // namespace
}  // namespace tp_ext::ops

TORCH_LIBRARY_IMPL(tp_ext, CPU, m) { m.impl("rotary_embedding", &tp_ext::ops::rotary_cpu); }

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("rotary_embedding", &tp_ext::ops::rotary_autograd);
}
