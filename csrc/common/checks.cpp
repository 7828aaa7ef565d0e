#include "checks.h"

#include <sstream>

namespace tp_ext {

void check_tensor(const at::Tensor& x, const char* arg, const char* op) {
  TORCH_CHECK_VALUE(x.defined(), "tp_ext.", op, ": ", arg, " is an undefined tensor.");
  TORCH_CHECK_VALUE(x.layout() == at::kStrided, "tp_ext.", op, ": ", arg,
                    " must be a dense (strided) tensor, got layout ", x.layout(),
                    "; call .to_dense() first.");
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* arg, const char* op) {
  TORCH_CHECK_VALUE(ndim >= 1, "tp_ext.", op,
                    ": needs a tensor with at least one dimension, got a 0-d tensor; reshape it "
                    "with x.reshape(1).");
  TORCH_CHECK_VALUE(dim >= -ndim && dim < ndim, "tp_ext.", op, ": ", arg, "=", dim,
                    " is out of range for a tensor with ", ndim, " dimensions; use a value in [",
                    -ndim, ", ", ndim - 1, "].");
  return dim < 0 ? dim + ndim : dim;
}

void check_linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, const char* op) {
  check_tensor(x, "x", op);
  check_tensor(weight, "weight", op);
  TORCH_CHECK_VALUE(weight.dim() == 2, "tp_ext.", op, ": weight must be 2-D [out, in], got shape ",
                    shape_str(weight.sizes()), ".");
  const int64_t in_features = weight.size(1);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == in_features, "tp_ext.", op, ": x has shape ",
                    shape_str(x.sizes()), " but weight [", weight.size(0), ", ", weight.size(1),
                    "] takes ", in_features, " input features (x.shape[-1]).");
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type(), "tp_ext.", op, ": x has dtype ",
                    x.scalar_type(), " but weight has ", weight.scalar_type(), ".");
  if (bias.has_value() && bias->defined()) {
    check_tensor(*bias, "bias", op);
    TORCH_CHECK_VALUE(bias->scalar_type() == weight.scalar_type(), "tp_ext.", op,
                      ": bias has dtype ", bias->scalar_type(), " but weight has ",
                      weight.scalar_type(), ".");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "tp_ext.", op,
                      ": bias has shape ", shape_str(bias->sizes()), "; it must be [",
                      weight.size(0), "] (weight.size(0)).");
  }
}

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

void check_logits(const at::Tensor& logits, const char* op) {
  TORCH_CHECK_VALUE(logits.defined(), "tp_ext.", op, ": logits is an undefined tensor.");
  TORCH_CHECK_VALUE(logits.layout() == at::kStrided, "tp_ext.", op,
                    ": logits must be a dense (strided) tensor, got layout ", logits.layout(),
                    "; call .to_dense() first.");
  const auto dt = logits.scalar_type();
  TORCH_CHECK_VALUE(
      dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf, "tp_ext.",
      op, ": logits must be floating point (float32, float64, bfloat16 or float16), got ", dt, ".");
  TORCH_CHECK_VALUE(logits.dim() >= 1, "tp_ext.", op,
                    ": logits must have a vocabulary dimension (shape [..., V_local]), got a 0-d "
                    "tensor.");
}

}  // namespace tp_ext
