// tp_ext.summa_linear: Y = X W^T (X [T, K] tokens x in_features, W [N, K]) on a P x Q grid of
// ranks, by SUMMA. Rank (i, j) holds x = X[rows of grid row i, K-part j of x_in_sizes] and
// weight = W[N-rows of grid column j, K-part i of w_in_sizes] and gets Y[rows of i, N-rows of j].
// Its row group is (i, 0..Q-1), where it is rank j; its column group is (0..P-1, j), rank i.
//
// K is cut into panels at the union of both splits' boundaries, so each panel [a, b) lies in one
// x part ja and one w part ib. Forward, per panel: (i, ja) broadcasts its x columns [a, b) over
// the row group, (ib, j) its weight columns [a, b) over the column group, and every rank adds
// x_panel @ w_panel^T. Backward (summa_linear_backward), per panel: the same two broadcasts, then
// grad @ w_panel is summed over the row group into (i, ja), which keeps it as its grad_x columns,
// and grad^T @ x_panel over the column group into (ib, j), its grad_w columns.
//
// The next panel's broadcasts are started before the current panel's GEMMs and finished after
// them (comm::broadcast_start / finish), so communication overlaps compute; the backward's
// reductions are finished one panel late for the same reason. Every rank runs the same sequence
// of starts and finishes (the panels depend only on the two size lists), which is what keeps the
// row and column groups' rounds from deadlocking (collectives.cpp).
#include <torch/autograd.h>
#include <torch/library.h>

#include <numeric>
#include <optional>

#include "../comm/collectives.h"
#include "../common/checks.h"
#include "../common/dispatch.h"
#include "../common/gemm.h"
#include "../common/group.h"

namespace tp_ext::ops {
namespace {

constexpr const char* kOp = "summa_linear";
constexpr const char* kBackwardOp = "summa_linear_backward";

// Columns [begin, end) of K; they are x part `xpart` (starting at column x_at of it) and w part
// `wpart` (starting at w_at).
struct Panel {
  int64_t begin, end, xpart, wpart, x_at, w_at;
  int64_t width() const { return end - begin; }
};

std::vector<Panel> panels_of(at::IntArrayRef x_in_sizes, at::IntArrayRef w_in_sizes) {
  const int64_t k = std::accumulate(x_in_sizes.begin(), x_in_sizes.end(), int64_t{0});
  std::vector<Panel> out;
  int64_t a = 0, x0 = 0, w0 = 0;  // x0, w0: first column of parts xj, wi
  size_t xj = 0, wi = 0;
  while (a < k) {
    while (x0 + x_in_sizes[xj] <= a) x0 += x_in_sizes[xj++];  // skips empty and finished parts
    while (w0 + w_in_sizes[wi] <= a) w0 += w_in_sizes[wi++];
    const int64_t b = std::min(x0 + x_in_sizes[xj], w0 + w_in_sizes[wi]);
    out.push_back({a, b, static_cast<int64_t>(xj), static_cast<int64_t>(wi), a - x0, a - w0});
    a = b;
  }
  return out;
}

void check_sizes(at::IntArrayRef sizes, const char* arg, int64_t parts, const char* parts_arg,
                 const char* op) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(sizes.size()) == parts, "tp_ext.", op, ": ", arg, "=",
                    shape_str(sizes), " has ", sizes.size(), " entries but ", parts_arg, "=", parts,
                    "; give one size per grid ",
                    parts_arg == std::string("grid_cols") ? "column" : "row",
                    ", e.g. tp_ext.shard_sizes(in_features, ", parts, ").");
  for (size_t r = 0; r < sizes.size(); ++r)
    TORCH_CHECK_VALUE(sizes[r] >= 0, "tp_ext.", op, ": ", arg, "[", r, "]=", sizes[r],
                      " is negative; sizes must be >= 0.");
}

void check_position(int64_t n, const char* n_arg, int64_t at, const char* at_arg, const char* op) {
  TORCH_CHECK_VALUE(n >= 1, "tp_ext.", op, ": ", n_arg, "=", n, " must be >= 1.");
  TORCH_CHECK_VALUE(at >= 0 && at < n, "tp_ext.", op, ": ", at_arg, "=", at, " is not in [0, ",
                    n_arg, "=", n, "); pass this rank's position in the grid.");
}

// Every argument check, before any communication, so bad arguments fail without a hang.
void check_args(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef x_in_sizes,
                at::IntArrayRef w_in_sizes, int64_t grid_cols, int64_t grid_col, int64_t grid_rows,
                int64_t grid_row, const char* op) {
  check_tensor(x, "x", op);
  check_tensor(weight, "weight", op);
  TORCH_CHECK_VALUE(x.dim() >= 1, "tp_ext.", op,
                    ": x is a 0-d tensor; it must be [..., in_features part].");
  TORCH_CHECK_VALUE(weight.dim() == 2, "tp_ext.", op, ": weight has shape ",
                    shape_str(weight.sizes()),
                    "; it must be 2-d [out_features part, in_features "
                    "part].");
  const auto dt = x.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
                    "tp_ext.", op, ": x has dtype ", dt,
                    "; use float32, float64, bfloat16 or float16.");
  TORCH_CHECK_VALUE(weight.scalar_type() == dt, "tp_ext.", op, ": weight has dtype ",
                    weight.scalar_type(), " but x has ", dt, "; convert one to the other's dtype.");
  TORCH_CHECK_VALUE(weight.device() == x.device(), "tp_ext.", op, ": weight is on ",
                    weight.device(), " but x is on ", x.device(), "; put both on one device.");
  check_position(grid_cols, "grid_cols", grid_col, "grid_col", op);
  check_position(grid_rows, "grid_rows", grid_row, "grid_row", op);
  check_sizes(x_in_sizes, "x_in_sizes", grid_cols, "grid_cols", op);
  check_sizes(w_in_sizes, "w_in_sizes", grid_rows, "grid_rows", op);
  const int64_t kx = std::accumulate(x_in_sizes.begin(), x_in_sizes.end(), int64_t{0});
  const int64_t kw = std::accumulate(w_in_sizes.begin(), w_in_sizes.end(), int64_t{0});
  TORCH_CHECK_VALUE(kx == kw, "tp_ext.", op, ": x_in_sizes=", shape_str(x_in_sizes), " add up to ",
                    kx, " but w_in_sizes=", shape_str(w_in_sizes), " add up to ", kw,
                    "; both split the same in_features, so their sums must be equal.");
  TORCH_CHECK_VALUE(x.size(-1) == x_in_sizes[grid_col], "tp_ext.", op, ": x.size(-1)=", x.size(-1),
                    " but x_in_sizes[grid_col=", grid_col, "]=", x_in_sizes[grid_col],
                    "; x must hold grid column ", grid_col, "'s part of in_features (",
                    x_in_sizes[grid_col], " columns).");
  TORCH_CHECK_VALUE(weight.size(1) == w_in_sizes[grid_row], "tp_ext.", op,
                    ": weight.size(1)=", weight.size(1), " but w_in_sizes[grid_row=", grid_row,
                    "]=", w_in_sizes[grid_row], "; weight must hold grid row ", grid_row,
                    "'s part of in_features (", w_in_sizes[grid_row], " columns).");
}

// The row group (this rank is grid_col of grid_cols) and the column group (grid_row of grid_rows).
struct Grid {
  Group row, col;
};

Grid resolve_grid(const at::Tensor& x, c10::string_view row_group_name, int64_t grid_cols,
                  int64_t grid_col, c10::string_view col_group_name, int64_t grid_rows,
                  int64_t grid_row, const char* op) {
  return {resolve_group(row_group_name, grid_cols, x.device(), op, grid_col),
          resolve_group(col_group_name, grid_rows, x.device(), op, grid_row)};
}

int64_t leading(const at::Tensor& x) {  // product of every dim but the last (0 allowed)
  return c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
}

// A tensor of this shape and dtype with no memory behind it: what the ranks that receive a
// broadcast pass (only its shape and dtype count there).
at::Tensor shape_only(at::IntArrayRef shape, const at::TensorOptions& opts) {
  return at::empty({}, opts).expand(shape);
}

// Starts panel p's broadcasts: columns of x2 [T, k] over the row group from p.xpart, and of w2
// [N, k] over the column group from p.wpart.
struct PanelData {
  comm::Pending x, w;
};

PanelData start_panel(const Panel& p, const at::Tensor& x2, const at::Tensor& w2, const Grid& g,
                      const char* op) {
  const int64_t n = p.width();
  const auto xp =
      g.row.rank == p.xpart ? x2.narrow(1, p.x_at, n) : shape_only({x2.size(0), n}, x2.options());
  const auto wp =
      g.col.rank == p.wpart ? w2.narrow(1, p.w_at, n) : shape_only({w2.size(0), n}, w2.options());
  return {comm::broadcast_start(xp, p.xpart, g.row, op),
          comm::broadcast_start(wp, p.wpart, g.col, op)};
}

at::Tensor summa_linear_kernel(const at::Tensor& x, const at::Tensor& weight,
                               at::IntArrayRef x_in_sizes, at::IntArrayRef w_in_sizes,
                               c10::string_view row_group_name, int64_t grid_cols, int64_t grid_col,
                               c10::string_view col_group_name, int64_t grid_rows,
                               int64_t grid_row) {
  check_args(x, weight, x_in_sizes, w_in_sizes, grid_cols, grid_col, grid_rows, grid_row, kOp);
  const auto g = resolve_grid(x, row_group_name, grid_cols, grid_col, col_group_name, grid_rows,
                              grid_row, kOp);
  const int64_t t = leading(x), n = weight.size(0);
  const auto x2 = x.reshape({t, x.size(-1)});
  const auto panels = panels_of(x_in_sizes, w_in_sizes);
  // bf16/fp16: each panel's GEMM in the input dtype (fp32 accumulation inside), the sum over
  // panels in fp32, rounded once at the end.
  const bool widen = at::isReducedFloatingType(x.scalar_type());
  auto acc = at::zeros({t, n}, x.options().dtype(widen ? at::kFloat : x.scalar_type()));
  std::optional<PanelData> cur;
  if (!panels.empty()) cur = start_panel(panels[0], x2, weight, g, kOp);
  for (size_t k = 0; k < panels.size(); ++k) {
    std::optional<PanelData> next;
    if (k + 1 < panels.size()) next = start_panel(panels[k + 1], x2, weight, g, kOp);
    const auto xp = comm::finish(cur->x);
    const auto wp = comm::finish(cur->w);
    if (widen)
      acc.add_(tp_ext::matmul(xp, wp.t()));
    else
      tp_ext::add_matmul_(acc, xp, wp.t());
    cur = std::move(next);
  }
  auto shape = x.sizes().vec();
  shape.back() = n;
  return (widen ? acc.to(x.scalar_type()) : acc).view(shape);
}

// Panel p's two partial gradients on their way to the ranks that own those columns.
struct PanelGrads {
  const Panel* panel;
  comm::Pending gx, gw;
};

void finish_grads(PanelGrads& r, at::Tensor& grad_x, at::Tensor& grad_w, const Grid& g) {
  const auto gx = comm::finish(r.gx);
  const auto gw = comm::finish(r.gw);
  const Panel& p = *r.panel;
  if (g.row.rank == p.xpart) grad_x.narrow(1, p.x_at, p.width()).copy_(gx);
  if (g.col.rank == p.wpart) grad_w.narrow(1, p.w_at, p.width()).copy_(gw);
}

std::tuple<at::Tensor, at::Tensor> summa_linear_backward_kernel(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
    at::IntArrayRef x_in_sizes, at::IntArrayRef w_in_sizes, c10::string_view row_group_name,
    int64_t grid_cols, int64_t grid_col, c10::string_view col_group_name, int64_t grid_rows,
    int64_t grid_row) {
  check_args(x, weight, x_in_sizes, w_in_sizes, grid_cols, grid_col, grid_rows, grid_row,
             kBackwardOp);
  check_tensor(grad, "grad", kBackwardOp);
  auto want = x.sizes().vec();
  want.back() = weight.size(0);
  TORCH_CHECK_VALUE(grad.sizes() == at::IntArrayRef(want), "tp_ext.", kBackwardOp,
                    ": grad has shape ", shape_str(grad.sizes()), " but the output is ",
                    shape_str(want),
                    " (x.shape[:-1] + [weight.size(0)]); pass the gradient of "
                    "summa_linear's output.");
  TORCH_CHECK_VALUE(grad.scalar_type() == x.scalar_type(), "tp_ext.", kBackwardOp,
                    ": grad has dtype ", grad.scalar_type(), " but x has ", x.scalar_type(), ".");
  const auto g = resolve_grid(x, row_group_name, grid_cols, grid_col, col_group_name, grid_rows,
                              grid_row, kBackwardOp);
  const int64_t t = leading(x), n = weight.size(0);
  const auto x2 = x.reshape({t, x.size(-1)});
  const auto g2 = grad.reshape({t, n});
  const auto panels = panels_of(x_in_sizes, w_in_sizes);
  // Every column of this rank's x and weight lies in exactly one panel that it owns, so both
  // are written in full.
  auto grad_x = at::empty({t, x.size(-1)}, x.options());
  auto grad_w = at::empty(weight.sizes(), weight.options());
  std::optional<PanelData> cur;
  std::optional<PanelGrads> sent;  // the previous panel's reductions, finished one panel late
  if (!panels.empty()) cur = start_panel(panels[0], x2, weight, g, kBackwardOp);
  for (size_t k = 0; k < panels.size(); ++k) {
    std::optional<PanelData> next;
    if (k + 1 < panels.size()) next = start_panel(panels[k + 1], x2, weight, g, kBackwardOp);
    const auto xp = comm::finish(cur->x);
    const auto wp = comm::finish(cur->w);
    const Panel& p = panels[k];
    // [T, width]: summed over the row group into x's owner; [N, width]: over the column group
    // into weight's owner. A rank of a row without tokens still sends zeros to its column.
    PanelGrads mine{
        &p,
        comm::reduce_start(tp_ext::matmul(g2, wp), p.xpart, comm::Reduce::Sum, g.row, kBackwardOp),
        comm::reduce_start(tp_ext::matmul(g2.t(), xp), p.wpart, comm::Reduce::Sum, g.col,
                           kBackwardOp)};
    if (sent) finish_grads(*sent, grad_x, grad_w, g);
    sent = std::move(mine);
    cur = std::move(next);
  }
  if (sent) finish_grads(*sent, grad_x, grad_w, g);
  return {grad_x.view(x.sizes()), grad_w};
}

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                              at::IntArrayRef, c10::string_view, int64_t, int64_t, c10::string_view,
                              int64_t, int64_t);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, at::IntArrayRef,
                                                       at::IntArrayRef, c10::string_view, int64_t,
                                                       int64_t, c10::string_view, int64_t, int64_t);

class SummaLinear : public torch::autograd::Function<SummaLinear> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, std::vector<int64_t> x_in_sizes,
                            std::vector<int64_t> w_in_sizes, const std::string& row_group_name,
                            int64_t grid_cols, int64_t grid_col, const std::string& col_group_name,
                            int64_t grid_rows, int64_t grid_row) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["x_in_sizes"] = x_in_sizes;
    ctx->saved_data["w_in_sizes"] = w_in_sizes;
    ctx->saved_data["row_group_name"] = row_group_name;
    ctx->saved_data["grid_cols"] = grid_cols;
    ctx->saved_data["grid_col"] = grid_col;
    ctx->saved_data["col_group_name"] = col_group_name;
    ctx->saved_data["grid_rows"] = grid_rows;
    ctx->saved_data["grid_row"] = grid_row;
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = op_handle(kOp).typed<ForwardSig>();
    return op.call(x, weight, x_in_sizes, w_in_sizes, row_group_name, grid_cols, grid_col,
                   col_group_name, grid_rows, grid_row);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    const auto x_in_sizes = d.at("x_in_sizes").toIntVector();
    const auto w_in_sizes = d.at("w_in_sizes").toIntVector();
    at::Tensor grad_x, grad_w;
    if (grads[0].defined()) {
      static const auto op = op_handle(kBackwardOp).typed<BackwardSig>();
      std::tie(grad_x, grad_w) =
          op.call(grads[0], saved[0], saved[1], x_in_sizes, w_in_sizes,
                  d.at("row_group_name").toStringRef(), d.at("grid_cols").toInt(),
                  d.at("grid_col").toInt(), d.at("col_group_name").toStringRef(),
                  d.at("grid_rows").toInt(), d.at("grid_row").toInt());
    }
    return {grad_x,       grad_w,       at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor summa_linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                                 at::IntArrayRef x_in_sizes, at::IntArrayRef w_in_sizes,
                                 c10::string_view row_group_name, int64_t grid_cols,
                                 int64_t grid_col, c10::string_view col_group_name,
                                 int64_t grid_rows, int64_t grid_row) {
  return SummaLinear::apply(x, weight, x_in_sizes.vec(), w_in_sizes.vec(),
                            std::string(row_group_name), grid_cols, grid_col,
                            std::string(col_group_name), grid_rows, grid_row);
}

void register_kernels(torch::Library& m) {
  m.impl("summa_linear", &summa_linear_kernel);
  m.impl("summa_linear_backward", &summa_linear_backward_kernel);
}

}  // namespace
}  // namespace tp_ext::ops

// Device-generic (no .cu): the GEMMs dispatch to the tensors' device and the broadcasts and
// reductions go through the process groups' backends (gloo: CPU, NCCL: CUDA).
TORCH_LIBRARY_IMPL(tp_ext, CPU, m) { tp_ext::ops::register_kernels(m); }
TORCH_LIBRARY_IMPL(tp_ext, CUDA, m) { tp_ext::ops::register_kernels(m); }

TORCH_LIBRARY_IMPL(tp_ext, Autograd, m) {
  m.impl("summa_linear", &tp_ext::ops::summa_linear_autograd);
  // No double backward.
  m.impl("summa_linear_backward", torch::autograd::autogradNotImplementedFallback());
}
