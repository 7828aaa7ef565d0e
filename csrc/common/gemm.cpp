#include "gemm.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>
#include <cstdlib>
#include <optional>

namespace tp_ext {
namespace {

constexpr const char* kEnv = "TP_EXT_CPU_GEMM";

// 1: oneDNN, 0: aten, -1: not read yet.
std::atomic<int> g_onednn{-1};

int parse(const std::string& name, const char* where) {
  if (name == "onednn") return 1;
  TORCH_CHECK_VALUE(name == "aten", where, "='", name,
                    "' is not a CPU GEMM; use 'onednn' (oneDNN's matmul, the default) or 'aten' "
                    "(aten::mm, MKL).");
  return 0;
}

bool onednn_setting() {
  int v = g_onednn.load();
  if (v < 0) {
    const char* env = std::getenv(kEnv);
    int read = env == nullptr || *env == '\0' ? 1 : parse(env, kEnv);
    // a set_cpu_gemm() that came first wins: it is not overwritten by the environment
    g_onednn.compare_exchange_strong(v, read);
    v = g_onednn.load();
  }
  return v == 1;
}

// mkldnn::_linear_pointwise, or nothing where this build lacks it. Called boxed: its unboxed C++
// signature is internal to torch and has changed between releases; the schema has not.
const std::optional<c10::OperatorHandle>& onednn_linear_op() {
  static const std::optional<c10::OperatorHandle> op = [] {
    std::optional<c10::OperatorHandle> h;
    if (at::hasMKLDNN())
      h = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    return h;
  }();
  return op;
}

// oneDNN's op has no derivative: a call that autograd records keeps aten's.
bool eligible(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() &&
         t.scalar_type() == at::kFloat && t.numel() > 0 &&
         !(t.requires_grad() && at::GradMode::is_enabled());
}

// x [m, in] (rows) times weight [out, in] transposed, through oneDNN.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(bias.defined() ? c10::IValue(bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())));
  stack.emplace_back(c10::IValue());
  onednn_linear_op()->callBoxed(stack);
  return stack.back().toTensor();
}

// Whether linear() and matmul() on these float32 CPU tensors take oneDNN (the setting, this build).
bool uses_onednn(const at::Tensor& a) {
  // torch.backends.mkldnn.flags(enabled=False) turns it off too, as for aten's own oneDNN paths
  return eligible(a) && onednn_setting() && at::globalContext().userEnabledMkldnn() &&
         onednn_linear_op().has_value();
}

}  // namespace

std::string cpu_gemm() { return onednn_setting() ? "onednn" : "aten"; }

void set_cpu_gemm(const std::string& name) { g_onednn.store(parse(name, "cpu_gemm")); }

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  // oneDNN reads the bias as contiguous whatever its strides
  if (!uses_onednn(x) || !eligible(weight) ||
      (bias.defined() && (!eligible(bias) || !bias.is_contiguous())))
    return at::linear(x, weight, bias);
  const auto rows = x.reshape({-1, x.size(-1)});
  // oneDNN's op copies a strided input (the weight gradient's grad^T): a transient tensor of the
  // output gradient's size that aten's GEMM does not need, so that case stays aten's.
  if (!rows.is_contiguous()) return at::linear(x, weight, bias);
  auto out_shape = x.sizes().vec();
  out_shape.back() = weight.size(0);
  return onednn_linear(rows, weight, bias).view(out_shape);
}

at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) {
  if (!uses_onednn(a) || !eligible(b)) return at::matmul(a, b);
  return tp_ext::linear(a, b.t());
}

void add_matmul_(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (!uses_onednn(a) || !eligible(b) || out.scalar_type() != at::kFloat || !a.is_contiguous()) {
    out.addmm_(a, b);
    return;
  }
  out.add_(onednn_linear(a, b.t(), at::Tensor()));
}

}  // namespace tp_ext
