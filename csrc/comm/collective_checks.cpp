#include "collective_checks.h"

#include <atomic>
#include <cstdlib>
#include <numeric>
#include <sstream>

#include "../common/checks.h"

namespace tp_ext::comm {

namespace {
std::atomic<int64_t> g_timeout_ms{0};

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) != "" && std::string(v) != "0";
}
std::atomic<bool> g_consistency_checks{env_flag("TP_EXT_CHECK_COLLECTIVES")};
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

void set_consistency_checks(bool on) { g_consistency_checks = on; }
bool consistency_checks() { return g_consistency_checks; }

void check_consistent(const Group& g, const char* op, const at::Tensor& x, int64_t free_dim,
                      int64_t extra) {
  if (!g_consistency_checks || g.size == 1) return;
  constexpr int64_t kMaxDims = 8;
  constexpr int64_t kLen = 4 + kMaxDims;
  std::vector<int64_t> fp(kLen, -1);
  fp[0] = static_cast<int64_t>(std::hash<std::string>{}(op) & 0x7fffffffffff);
  fp[1] = static_cast<int64_t>(x.scalar_type());
  fp[2] = x.dim();
  fp[3] = extra;
  for (int64_t d = 0; d < std::min<int64_t>(x.dim(), kMaxDims); ++d)
    fp[4 + d] = d == free_dim ? -2 : x.size(d);
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
  std::ostringstream os;
  os << "tp_ext." << op << ": ranks of process group '" << g.name
     << "' called collectives that do not match (op, dtype, shape";
  if (free_dim >= 0) os << " outside dim " << free_dim;
  os << ", or other arguments):";
  for (int64_t r = 0; r < g.size; ++r) {
    std::vector<int64_t> shape;
    for (int64_t d = 0; d < std::min<int64_t>(acc[r][2], kMaxDims); ++d)
      shape.push_back(acc[r][4 + d]);
    os << "\n  rank " << r << ": op#" << acc[r][0]
       << " dtype=" << c10::toString(static_cast<at::ScalarType>(acc[r][1]))
       << " shape=" << shape_str(shape) << " arg=" << acc[r][3];
  }
  os << "\nEvery rank must call the same collective with the same dtype and shape.";
  TORCH_CHECK_VALUE(false, os.str());
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
