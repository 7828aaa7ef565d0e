#include "shm_channel.h"

#include <c10/util/intrusive_ptr.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace tp_ext::comm {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kLine = 64;                         // one cache line per rank's counter
constexpr int64_t kDefaultSlotBytes = int64_t(1) << 20;  // per rank and buffer

std::atomic<bool> g_enabled{[] {
  const char* v = std::getenv("TP_EXT_SHM");
  return v == nullptr || std::string(v) != "0";
}()};

int64_t slot_bytes_setting() {
  const char* v = std::getenv("TP_EXT_SHM_SLOT_BYTES");
  if (v == nullptr || *v == '\0') return kDefaultSlotBytes;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  TORCH_CHECK_VALUE(end != v && *end == '\0' && n >= 4096 && n % kLine == 0,
                    "tp_ext: TP_EXT_SHM_SLOT_BYTES='", v,
                    "' must be a whole number of bytes, >= 4096 and a multiple of 64 (default ",
                    kDefaultSlotBytes, ").");
  return n;
}

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string inode_of(const char* path) {
  struct stat st {};
  return ::stat(path, &st) == 0 ? std::to_string(st.st_ino) : "?";
}

// Ranks can share a segment only on the same machine, boot, and IPC and PID namespaces (the pids
// are used to notice a peer that exited).
int64_t host_key() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const std::string id = std::string(host) + "|" +
                         read_first_line("/proc/sys/kernel/random/boot_id") + "|" +
                         inode_of("/proc/self/ns/ipc") + "|" + inode_of("/proc/self/ns/pid");
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : id) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h & 0x7fffffffffffffffull);
}

// Row r of an all-gather of `mine` (int64 values) over g's process group.
std::vector<std::vector<int64_t>> gather_ints(const Group& g, const std::vector<int64_t>& mine) {
  const int64_t n = static_cast<int64_t>(mine.size());
  auto in = at::empty({n}, at::kLong);
  std::memcpy(in.data_ptr<int64_t>(), mine.data(), n * sizeof(int64_t));
  auto out = at::empty({g.size * n}, at::kLong);
  c10d::AllgatherOptions opts;
  opts.timeout = op_timeout();
  wait(g.pg->_allgather_base(out, in, opts), "shared-memory setup", g);
  std::vector<std::vector<int64_t>> rows(g.size);
  for (int64_t r = 0; r < g.size; ++r)
    rows[r].assign(out.data_ptr<int64_t>() + r * n, out.data_ptr<int64_t>() + (r + 1) * n);
  return rows;
}

bool all_ok(const std::vector<std::vector<int64_t>>& rows) {
  for (const auto& row : rows)
    if (row[0] != 1) return false;
  return true;
}

// A peer counts as gone when its process no longer exists or is a zombie.
bool process_gone(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return true;
  std::string line;
  std::getline(f, line);
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  const char state = line[close + 2];
  return state == 'Z' || state == 'X';
}

std::chrono::milliseconds collective_timeout(const Group& g) {
  if (timeout_ms() > 0) return std::chrono::milliseconds(timeout_ms());
  try {
    const auto opts = g.pg->getBackend(c10::DeviceType::CPU)->getBackendOptions();
    if (opts && opts->timeout.count() > 0) return opts->timeout;
  } catch (const std::exception&) {
  }
  return std::chrono::minutes(30);  // c10d's default
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

struct Entry {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> pg;
  std::shared_ptr<ShmChannel> channel;  // null: the group uses its process group only
  std::string name;
};
std::mutex g_registry_mu;
std::unordered_map<const c10d::ProcessGroup*, Entry>& registry() {
  static auto* r = new std::unordered_map<const c10d::ProcessGroup*, Entry>();
  return *r;
}
std::atomic<int64_t> g_segments_made{0};

}  // namespace

void set_shm_enabled(bool on) { g_enabled = on; }
bool shm_enabled() { return g_enabled; }

bool shm_active(c10::string_view group_name) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  for (auto& [key, entry] : registry())
    if (entry.name == group_name && !entry.pg.expired()) return entry.channel != nullptr;
  return false;
}

ShmChannel::ShmChannel(char* base, int64_t mapped_bytes, int64_t rank, int64_t size,
                       int64_t slot_bytes, std::vector<int64_t> pids)
    : base_(base),
      mapped_bytes_(mapped_bytes),
      rank_(rank),
      size_(size),
      slot_bytes_(slot_bytes),
      pids_(std::move(pids)) {}

ShmChannel::~ShmChannel() { ::munmap(base_, mapped_bytes_); }

std::atomic<uint64_t>& ShmChannel::arrived(int64_t r) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(base_ + r * kLine);
}

// Two buffers used in turn: a rank writes buffer (seq & 1) only after every rank has arrived at
// collective seq - 1, hence finished reading collective seq - 2 from that buffer.
char* ShmChannel::slot(uint64_t seq, int64_t r) const {
  return base_ + size_ * kLine + ((seq & 1) * size_ + r) * slot_bytes_;
}

std::shared_ptr<ShmChannel> ShmChannel::of(const Group& g) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto& reg = registry();
  for (auto it = reg.begin(); it != reg.end();)  // drop the channels of destroyed groups
    it = it->second.pg.expired() ? reg.erase(it) : std::next(it);
  auto found = reg.find(g.pg.get());
  if (found != reg.end()) return found->second.channel;
  auto channel = create(g);
  reg.emplace(g.pg.get(), Entry{c10::weak_intrusive_ptr<c10d::ProcessGroup>(g.pg), channel,
                                g.name});
  return channel;
}

std::shared_ptr<ShmChannel> ShmChannel::create(const Group& g) {
  std::string backend;
  try {
    backend = g.pg->getBackend(c10::DeviceType::CPU)->getBackendName();
  } catch (const std::exception&) {
  }
  // Not gloo (a fake or custom backend): no setup collective either, on every rank alike.
  if (backend != "gloo" || g.size < 2) return nullptr;

  // Round 1: can every rank take part, on one host, and how big are the slots (rank 0 decides)?
  const int64_t made = g.rank == 0 ? g_segments_made.fetch_add(1) : 0;
  const auto info = gather_ints(g, {g_enabled ? 1 : 0, host_key(), static_cast<int64_t>(::getpid()),
                                    slot_bytes_setting(), made});
  for (const auto& row : info)
    if (row[0] != 1 || row[1] != info[0][1]) return nullptr;
  const int64_t slot_bytes = info[0][3];
  std::vector<int64_t> pids;
  for (const auto& row : info) pids.push_back(row[2]);
  const std::string name = "/tp_ext_" + std::to_string(pids[0]) + "_" + std::to_string(info[0][4]);
  const int64_t bytes = g.size * kLine + 2 * g.size * slot_bytes;

  // Round 2: rank 0 creates the segment (fallocate: fail now rather than SIGBUS on a full
  // /dev/shm); round 3: the others map it; then rank 0 unlinks the name, so nothing outlives the
  // processes that hold the mapping.
  char* base = nullptr;
  auto map_fd = [&](int fd) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    base = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
    return base != nullptr;
  };
  bool ok = true;
  if (g.rank == 0) {
    ::shm_unlink(name.c_str());
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      ok = false;
    } else if (::posix_fallocate(fd, 0, bytes) != 0) {
      ::close(fd);
      ok = false;
    } else {
      ok = map_fd(fd);
    }
  }
  if (!all_ok(gather_ints(g, {ok ? 1 : 0}))) {
    if (g.rank == 0) ::shm_unlink(name.c_str());
    if (base) ::munmap(base, bytes);
    return nullptr;
  }
  if (g.rank != 0) {
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
    ok = fd >= 0 && map_fd(fd);
  }
  const bool everyone = all_ok(gather_ints(g, {ok ? 1 : 0}));
  if (g.rank == 0) ::shm_unlink(name.c_str());
  if (!everyone) {
    if (base) ::munmap(base, bytes);
    return nullptr;
  }
  return std::shared_ptr<ShmChannel>(
      new ShmChannel(base, bytes, g.rank, g.size, slot_bytes, std::move(pids)));
}

void ShmChannel::wait_for_all(uint64_t seq, const char* op, const Group& g) {
  const auto start = Clock::now();
  const auto timeout = collective_timeout(g);
  auto next_liveness_check = start + std::chrono::milliseconds(20);
  for (int64_t polls = 0;; ++polls) {
    int64_t missing = -1;
    for (int64_t r = 0; r < size_ && missing < 0; ++r)
      if (arrived(r).load(std::memory_order_acquire) < seq) missing = r;
    if (missing < 0) return;
    // Spin briefly (a peer a few microseconds behind), then yield the core (ranks may outnumber
    // cores), then sleep (a peer that is computing for long should get the CPU).
    if (polls < 2000) {
      cpu_relax();
      continue;
    }
    const auto now = Clock::now();
    if (now - start < std::chrono::milliseconds(5)) {
      ::sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (now >= next_liveness_check) {
      next_liveness_check = now + std::chrono::milliseconds(20);
      if (process_gone(pids_[missing])) {
        broken_ = true;
        TORCH_CHECK(false, "tp_ext.", op, " failed on rank ", g.rank, " of process group '",
                    g.name, "' (", g.size, " ranks): rank ", missing, " (pid ", pids_[missing],
                    ") exited before joining this collective (shared-memory transport).");
      }
    }
    if (now - start > timeout) {
      broken_ = true;
      TORCH_CHECK(false, "tp_ext.", op, " failed on rank ", g.rank, " of process group '",
                  g.name, "' (", g.size, " ranks): timed out after ", timeout.count(),
                  " ms waiting for rank ", missing,
                  " to join this collective (shared-memory transport; tp_ext.comm.set_timeout "
                  "or the process group's timeout sets the limit).");
    }
  }
}

void ShmChannel::exchange(const void* data, int64_t nbytes,
                          const std::function<void(const std::vector<const char*>&)>& read,
                          const char* op, const Group& g) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!broken_, "tp_ext.", op, ": the shared-memory channel of process group '", g.name,
              "' failed in an earlier collective and its ranks are out of step; create a new "
              "process group.");
  TORCH_CHECK(nbytes >= 0 && nbytes <= slot_bytes_, "tp_ext.", op, ": ", nbytes,
              " bytes do not fit the shared-memory slot of ", slot_bytes_, " bytes.");
  const uint64_t seq = ++seq_;
  if (nbytes > 0) std::memcpy(slot(seq, rank_), data, nbytes);
  arrived(rank_).store(seq, std::memory_order_release);
  wait_for_all(seq, op, g);
  std::vector<const char*> slots(size_);
  for (int64_t r = 0; r < size_; ++r) slots[r] = slot(seq, r);
  read(slots);
}

}  // namespace tp_ext::comm
