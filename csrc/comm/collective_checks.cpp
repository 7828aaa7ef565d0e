#include "collective_checks.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>

#include "../common/checks.h"
#include "settings.h"

namespace tp_ext::comm {

namespace {
std::atomic<int64_t> g_timeout_ms{0};
// The check's switch: TP_EXT_CHECK_COLLECTIVES until set_consistency_checks(true/false). A bad
// value leaves it off here and is raised on every rank by the group's setup (shm_channel.cpp).
std::atomic<bool> g_consistency_checks{read_env().checks};
}  // namespace

void set_timeout_ms(int64_t ms) {
  TORCH_CHECK_VALUE(ms >= 0, "tp_ext.comm.set_timeout: timeout must be >= 0 seconds, got ",
                    ms / 1000.0, "; 0 means the process group's own timeout.");
  g_timeout_ms = ms;
}
int64_t timeout_ms() { return g_timeout_ms; }

std::chrono::milliseconds op_timeout() {
  int64_t ms = g_timeout_ms;
  return ms > 0 ? std::chrono::milliseconds(ms) : c10d::kUnsetTimeout;
}

void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* op, const Group& g) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    // Keep c10d's message (it says which peer or timeout) and add which tp_ext op was waiting.
    TORCH_CHECK(false, "tp_ext.", op, " failed on rank ", g.rank, " of process group '", g.name,
                "' (", g.size, " ranks): ", e.what());
  }
}

void set_consistency_checks(c10::optional<bool> on) {
  g_consistency_checks = on.has_value() ? *on : read_env().checks;
}
bool consistency_checks() { return g_consistency_checks; }

void check_consistent(const Group& g, const char* op, const at::Tensor& x, int64_t free_dim,
                      at::OptionalIntArrayRef sizes, int64_t extra) {
  if (!g_consistency_checks || g.size == 1) return;
  // One fixed-length row per rank: what the message shows (up to kMax dims and sizes), plus a
  // hash of everything, so differences beyond kMax entries are caught too.
  constexpr int64_t kMax = 8;
  enum { kOp, kDtype, kNdim, kExtra, kNsizes, kHash, kShape };
  constexpr int64_t kSizes = kShape + kMax, kLen = kSizes + kMax;
  std::vector<int64_t> shape = x.sizes().vec();
  if (free_dim >= 0) shape[free_dim] = -2;  // may differ between ranks (uneven gathers)
  const std::vector<int64_t> sz = sizes.has_value() ? sizes->vec() : std::vector<int64_t>{};
  std::vector<int64_t> fp(kLen, -1);
  fp[kOp] = static_cast<int64_t>(std::hash<std::string>{}(op) & 0x7fffffffffff);
  fp[kDtype] = static_cast<int64_t>(x.scalar_type());
  fp[kNdim] = x.dim();
  fp[kExtra] = extra;
  fp[kNsizes] = sizes.has_value() ? static_cast<int64_t>(sz.size()) : -1;
  fp[kHash] = static_cast<int64_t>(call_signature(0, x.scalar_type(), shape, sz, {}) >> 1);
  for (int64_t d = 0; d < std::min<int64_t>(x.dim(), kMax); ++d) fp[kShape + d] = shape[d];
  for (int64_t i = 0; i < std::min<int64_t>(sz.size(), kMax); ++i) fp[kSizes + i] = sz[i];
  auto mine = at::tensor(fp, at::TensorOptions().dtype(at::kLong)).to(x.device());
  auto all = at::empty({g.size * kLen}, mine.options());
  c10d::AllgatherOptions opts;
  opts.timeout = op_timeout();
  auto work = g.pg->_allgather_base(all, mine, opts);
  wait(work, op, g);
  auto table = all.cpu().view({g.size, kLen});
  auto acc = table.accessor<int64_t, 2>();
  bool same = true;
  for (int64_t r = 1; r < g.size && same; ++r)
    for (int64_t i = 0; i < kLen; ++i) same = same && acc[r][i] == acc[0][i];
  if (same) return;
  auto row = [&](int64_t r, int64_t at, int64_t n) {
    std::vector<int64_t> v;
    for (int64_t i = 0; i < std::min(n, kMax); ++i) v.push_back(acc[r][at + i]);
    return shape_str(v) + (n > kMax ? "..." : "");
  };
  std::ostringstream os;
  os << "tp_ext." << op << ": ranks of process group '" << g.name
     << "' called collectives that do not match (op, dtype, shape";
  if (free_dim >= 0) os << " outside dim " << free_dim << " (shown as -2)";
  os << ", sizes, or other arguments such as dim or reduce):";
  for (int64_t r = 0; r < g.size; ++r) {
    os << "\n  rank " << r << ": op#" << acc[r][kOp]
       << " dtype=" << c10::toString(static_cast<at::ScalarType>(acc[r][kDtype]))
       << " shape=" << row(r, kShape, acc[r][kNdim])
       << " sizes=" << (acc[r][kNsizes] < 0 ? "None" : row(r, kSizes, acc[r][kNsizes]))
       << " arg=" << acc[r][kExtra];
  }
  os << "\nEvery rank must call the same collective with the same dtype, shape, sizes and dim."
     << mismatch_hint(op);
  TORCH_CHECK_VALUE(false, os.str());
}

const char* mismatch_hint(const char* op) {
  const bool sequence_gather =
      std::strcmp(op, "gather_from_sp") == 0 || std::strcmp(op, "all_gather_linear") == 0;
  return sequence_gather ? " Sequence shards of a length that does not divide by the group size "
                           "need that length on every rank: seq_len= on tp_ext's layers, sizes= "
                           "on tp_ext.comm.gather_from_sp."
                         : "";
}

uint64_t call_signature(int64_t kind, at::ScalarType dtype, at::IntArrayRef shape,
                        at::IntArrayRef sizes, std::initializer_list<int64_t> args) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the values, each list prefixed by its length
  auto mix = [&](int64_t v) { h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull; };
  mix(kind);
  mix(static_cast<int64_t>(dtype));
  mix(static_cast<int64_t>(shape.size()));
  for (int64_t v : shape) mix(v);
  mix(static_cast<int64_t>(sizes.size()));
  for (int64_t v : sizes) mix(v);
  for (int64_t v : args) mix(v);
  return h;
}

std::vector<int64_t> rank_sizes(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                                const Group& g, bool for_full_input, const char* op) {
  const int64_t n = x.size(dim);
  if (!sizes.has_value()) {
    if (for_full_input) {
      TORCH_CHECK_VALUE(n % g.size == 0, "tp_ext.", op, ": x.size(", dim, ")=", n,
                        " does not divide evenly over group_size=", g.size,
                        "; pass sizes=tp_ext.shard_sizes(", n, ", ", g.size,
                        ") to split it unevenly.");
      return std::vector<int64_t>(g.size, n / g.size);
    }
    return std::vector<int64_t>(g.size, n);
  }
  auto s = sizes->vec();
  TORCH_CHECK_VALUE(static_cast<int64_t>(s.size()) == g.size, "tp_ext.", op, ": sizes has ",
                    s.size(), " entries but the group has ", g.size,
                    " ranks; give one size per rank, e.g. tp_ext.shard_sizes(n, ", g.size, ").");
  for (size_t r = 0; r < s.size(); ++r)
    TORCH_CHECK_VALUE(s[r] >= 0, "tp_ext.", op, ": sizes[", r, "]=", s[r], " is negative.");
  if (for_full_input) {
    const int64_t total = std::accumulate(s.begin(), s.end(), int64_t{0});
    TORCH_CHECK_VALUE(total == n, "tp_ext.", op, ": sizes ", shape_str(s), " add up to ", total,
                      " but x.size(", dim, ")=", n, "; use tp_ext.shard_sizes(", n, ", ", g.size,
                      ").");
  } else {
    TORCH_CHECK_VALUE(s[g.rank] == n, "tp_ext.", op, ": sizes[", g.rank, "]=", s[g.rank],
                      " (this rank) but x.size(", dim, ")=", n,
                      "; sizes must list every rank's size along dim.");
  }
  return s;
}

}  // namespace tp_ext::comm
