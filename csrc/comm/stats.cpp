#include "stats.h"

#include <atomic>
#include <map>
#include <mutex>

namespace tp_ext::comm {

namespace {
struct Totals {
  int64_t count = 0;
  int64_t bytes = 0;
  double seconds = 0.0;  // host time; for NCCL only the time to enqueue (stats.h)
};
std::atomic<bool> g_tracking{false};
std::mutex g_mutex;
std::string g_tag = "default";
std::map<std::tuple<std::string, std::string, std::string>, Totals> g_totals;
}  // namespace

bool tracking() { return g_tracking.load(std::memory_order_relaxed); }
void set_tracking(bool on) { g_tracking = on; }

void reset_stats() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_totals.clear();
}

std::vector<StatRow> stats_snapshot() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<StatRow> rows;
  for (const auto& [key, t] : g_totals)
    rows.emplace_back(std::get<0>(key), std::get<1>(key), std::get<2>(key), t.count, t.bytes,
                      t.seconds);
  return rows;
}

void set_tag(const std::string& tag) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_tag = tag;
}

std::string get_tag() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_tag;
}

void record(const char* op, const char* collective, int64_t bytes, double seconds) {
  if (!tracking()) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& t = g_totals[{g_tag, op, collective}];
  t.count += 1;
  t.bytes += bytes;
  t.seconds += seconds;
}

}  // namespace tp_ext::comm
