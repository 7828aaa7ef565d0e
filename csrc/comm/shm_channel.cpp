#include "shm_channel.h"

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "collective_checks.h"
#include "settings.h"

namespace tp_ext::comm {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kLine = 64;  // one cache line per rank's counter

// set_shm_enabled's value: -1 follows TP_EXT_SHM (read at each group's setup), else 0 / 1.
std::atomic<int> g_enabled{-1};

// The test-only hook of settings.h: rank 0 dies at `stage` of the setup.
void maybe_die(const char* stage, const Group& g) {
  if (g.rank == 0 && test_die_stage() == stage) ::raise(SIGKILL);
}

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string inode_of(const char* path) {
  struct stat st{};
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

// Whether this process can see itself in /proc (so a missing /proc entry means a dead peer).
bool proc_usable() {
  return static_cast<bool>(std::ifstream("/proc/" + std::to_string(::getpid()) + "/stat"));
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
  std::shared_ptr<std::mutex> setup_mu = std::make_shared<std::mutex>();
  bool decided = false;                 // guarded by *setup_mu
  std::shared_ptr<ShmChannel> channel;  // null: the group uses its process group only
};
std::mutex g_registry_mu;  // guards the map only; setup runs under the entry's own mutex
std::unordered_map<const c10d::ProcessGroup*, std::shared_ptr<Entry>>& registry() {
  static auto* r = new std::unordered_map<const c10d::ProcessGroup*, std::shared_ptr<Entry>>();
  return *r;
}

uint64_t random_nonce() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32 ^ rd()) & 0x7fffffffffffffffull;
}

}  // namespace

void set_shm_enabled(c10::optional<bool> on) { g_enabled = on.has_value() ? int(*on) : -1; }

bool shm_active(c10::string_view group_name) {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = c10d::resolve_process_group(std::string(group_name));
  } catch (const std::exception&) {
    return false;
  }
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    auto found = registry().find(pg.get());
    if (found == registry().end()) return false;
    entry = found->second;
  }
  std::lock_guard<std::mutex> lock(*entry->setup_mu);
  return entry->channel != nullptr;
}

struct alignas(64) ShmChannel::RankLine {
  std::atomic<uint64_t> arrived;   // the last collective this rank has published
  uint64_t signature[2];           // of collective seq at [seq & 1], written before `arrived`
  std::atomic<uint32_t> sleepers;  // ranks blocked on `wake` waiting for this rank to arrive
  std::atomic<uint32_t> wake;      // a futex word, bumped when this rank arrives with sleepers
};

namespace {

// Blocks until *word != expected, a wake, or `timeout` (shared, not process-private: the word
// lives in the segment every rank maps).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds timeout) {
  struct timespec ts{static_cast<time_t>(timeout.count() / 1000),
                     static_cast<long>(timeout.count() % 1000) * 1000000};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
            0);
}

}  // namespace

ShmChannel::ShmChannel(char* base, int64_t mapped_bytes, int64_t rank, int64_t size,
                       int64_t slot_bytes, std::vector<int64_t> pids)
    : base_(base),
      mapped_bytes_(mapped_bytes),
      rank_(rank),
      size_(size),
      slot_bytes_(slot_bytes),
      pids_(std::move(pids)) {}

ShmChannel::~ShmChannel() { ::munmap(base_, mapped_bytes_); }

ShmChannel::RankLine& ShmChannel::line(int64_t r) const {
  static_assert(sizeof(RankLine) == kLine, "one cache line per rank");
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters");
  return *reinterpret_cast<RankLine*>(base_ + r * kLine);
}

// Two buffers used in turn: a rank writes buffer (seq & 1) only after every rank has arrived at
// collective seq - 1, hence finished reading collective seq - 2 from that buffer.
char* ShmChannel::slot(uint64_t seq, int64_t r) const {
  return base_ + size_ * kLine + ((seq & 1) * size_ + r) * slot_bytes_;
}

std::shared_ptr<ShmChannel> ShmChannel::of(const Group& g, const char* op) {
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    auto& reg = registry();
    auto found = reg.find(g.pg.get());
    if (found == reg.end()) {  // a new group: drop the channels of destroyed ones first
      for (auto it = reg.begin(); it != reg.end();)
        it = it->second->pg.expired() ? reg.erase(it) : std::next(it);
      found = reg.emplace(g.pg.get(), std::make_shared<Entry>(
                                          Entry{c10::weak_intrusive_ptr<c10d::ProcessGroup>(g.pg)}))
                  .first;
    }
    entry = found->second;
  }
  // Setup talks to the other ranks: under this group's mutex only, so collectives of other
  // groups on other threads go on meanwhile.
  std::lock_guard<std::mutex> lock(*entry->setup_mu);
  if (!entry->decided) {
    entry->channel = create(g, op);
    entry->decided = true;
  }
  return entry->channel;
}

std::shared_ptr<ShmChannel> ShmChannel::create(const Group& g, const char* op) {
  const EnvSettings env = read_env();
  std::string backend;
  try {
    backend = g.pg->getBackend(c10::DeviceType::CPU)->getBackendName();
  } catch (const std::exception&) {
  }
  // Not gloo (a fake or custom backend): no setup collective either, on every rank alike; bad
  // settings are this rank's own error.
  if (backend != "gloo" || g.size < 2) {
    TORCH_CHECK_VALUE(env.error.empty(), env.error);
    return nullptr;
  }

  // Round 1: are every rank's settings valid; can every rank take part (switch on, /proc usable
  // to watch peers), on one host; with which slot size and segment name (rank 0's; its random
  // nonce keeps jobs that share /dev/shm from meeting, even with equal pids in different PID
  // namespaces)? Every rank decides from the same table, so all take the same transport.
  const bool enabled = g_enabled >= 0 ? g_enabled == 1 : env.shm;
  const auto info = gather_ints(
      g, {enabled && proc_usable() ? 1 : 0, host_key(), static_cast<int64_t>(::getpid()),
          env.slot_bytes, static_cast<int64_t>(g.rank == 0 ? random_nonce() : 0), env.bad});
  TORCH_CHECK_VALUE(env.error.empty(), env.error, " (rank ", g.rank, " of process group '", g.name,
                    "', at its first collective, tp_ext.", op, ")");
  for (int64_t r = 0; r < g.size; ++r)
    TORCH_CHECK_VALUE(info[r][5] == 0, "tp_ext.", op, ": rank ", r, " of process group '", g.name,
                      "' has an invalid environment setting:", describe_bad(info[r][5]),
                      "; its own error names the value. Fix it there (every rank raises).");
  for (const auto& row : info)
    if (row[0] != 1 || row[1] != info[0][1]) return nullptr;
  const int64_t slot_bytes = info[0][3];
  std::vector<int64_t> pids;
  for (const auto& row : info) pids.push_back(row[2]);
  const std::string name = "/tp_ext_" + std::to_string(pids[0]) + "_" + std::to_string(info[0][4]);
  const int64_t bytes = g.size * kLine + 2 * g.size * slot_bytes;

  // Round 2: rank 0 creates the segment (fallocate: fail now rather than SIGBUS on a full
  // /dev/shm); round 3: the others map it (after checking its size); then every rank unlinks the
  // name, so nothing outlives the processes that hold the mapping. A failed round on any rank
  // leaves every rank on gloo. Every rank knows the name from round 1, so when a peer is lost
  // during setup (rank 0 included: an exception here) the survivors unlink it too.
  char* base = nullptr;
  auto map_fd = [&](int fd) {
    struct stat st{};
    void* p = ::fstat(fd, &st) == 0 && st.st_size == bytes
                  ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
    ::close(fd);
    base = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
    return base != nullptr;
  };
  auto give_up = [&] {
    ::shm_unlink(name.c_str());  // whoever created it, and even if it never was (ENOENT)
    if (base != nullptr) ::munmap(base, bytes);
    base = nullptr;
  };
  try {
    bool ok = true;
    if (g.rank == 0) {
      const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        ok = false;
      } else if (::posix_fallocate(fd, 0, bytes) != 0) {
        ::close(fd);
        ok = false;
      } else {
        ok = map_fd(fd);
      }
      maybe_die("created", g);
    }
    if (!all_ok(gather_ints(g, {ok ? 1 : 0}))) {
      give_up();
      return nullptr;
    }
    if (g.rank != 0) {
      const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
      ok = fd >= 0 && map_fd(fd);
    }
    const bool everyone = all_ok(gather_ints(g, {ok ? 1 : 0}));
    maybe_die("mapped", g);
    ::shm_unlink(name.c_str());
    if (!everyone) {
      give_up();
      return nullptr;
    }
  } catch (...) {
    give_up();
    throw;
  }
  return std::shared_ptr<ShmChannel>(
      new ShmChannel(base, bytes, g.rank, g.size, slot_bytes, std::move(pids)));
}

void ShmChannel::wait_for_all(uint64_t seq, const char* op, const Group& g) {
  const auto start = Clock::now();
  std::chrono::milliseconds timeout{0};  // looked up once the wait is more than a spin
  auto next_liveness_check = start + std::chrono::milliseconds(20);
  for (int64_t polls = 0;; ++polls) {
    int64_t missing = -1;
    for (int64_t r = 0; r < size_ && missing < 0; ++r)
      if (line(r).arrived.load(std::memory_order_acquire) < seq) missing = r;
    if (missing < 0) return;
    // Spin briefly (a peer a few microseconds behind), then yield the core for up to 1 ms (ranks
    // may outnumber cores), then block on the missing rank's futex, which it bumps when it
    // arrives: a rank waiting for a peer that computes for long uses next to no CPU, and wakes at
    // once when the peer comes. The 20 ms cap keeps the liveness and timeout checks going.
    if (polls < 2000) {
      cpu_relax();
      continue;
    }
    if (timeout.count() == 0) timeout = collective_timeout(g);
    const auto now = Clock::now();
    if (now - start < std::chrono::milliseconds(1)) {
      ::sched_yield();
    } else {
      // Announce the sleeper before re-checking `arrived` (both seq_cst, as the publisher's store
      // of `arrived` and load of `sleepers`): either it sees us, or we see its arrival.
      RankLine& peer = line(missing);
      peer.sleepers.fetch_add(1);
      const uint32_t word = peer.wake.load();
      if (peer.arrived.load() < seq) futex_wait(&peer.wake, word, std::chrono::milliseconds(20));
      peer.sleepers.fetch_sub(1);
    }
    if (now >= next_liveness_check) {
      next_liveness_check = now + std::chrono::milliseconds(20);
      for (int64_t r = 0; r < size_; ++r) {
        if (line(r).arrived.load(std::memory_order_acquire) >= seq || !process_gone(pids_[r]))
          continue;
        broken_ = true;
        TORCH_CHECK(false, "tp_ext.", op, " failed on rank ", g.rank, " of process group '", g.name,
                    "' (", g.size, " ranks): rank ", r, " (pid ", pids_[r],
                    ") exited before joining this collective (shared-memory transport).");
      }
    }
    if (now - start > timeout) {
      broken_ = true;
      TORCH_CHECK(false, "tp_ext.", op, " failed on rank ", g.rank, " of process group '", g.name,
                  "' (", g.size, " ranks): timed out after ", timeout.count(),
                  " ms waiting for rank ", missing,
                  " to join this collective (shared-memory transport; tp_ext.comm.set_timeout "
                  "or the process group's timeout sets the limit).");
    }
  }
}

void ShmChannel::exchange(const void* data, int64_t nbytes, uint64_t signature,
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
  // Like the slots, signatures alternate: a rank may already be publishing collective seq + 1
  // while the others still check seq.
  line(rank_).signature[seq & 1] = signature;
  RankLine& mine = line(rank_);
  mine.arrived.store(seq);  // seq_cst: ordered before the load of sleepers (wait_for_all)
  if (mine.sleepers.load() > 0) {
    mine.wake.fetch_add(1);
    futex_wake_all(&mine.wake);
  }
  wait_for_all(seq, op, g);
  for (int64_t r = 0; r < size_; ++r) {
    if (line(r).signature[seq & 1] == signature) continue;
    broken_ = true;
    TORCH_CHECK(false, "tp_ext.", op, " failed on rank ", g.rank, " of process group '", g.name,
                "': rank ", r,
                " called a different collective (another op, dtype, shape or sizes) at the same "
                "point; every rank must make the same collective calls in the "
                "same order (TP_EXT_CHECK_COLLECTIVES=1 names the difference).",
                mismatch_hint(op));
  }
  std::vector<const char*> slots(size_);
  for (int64_t r = 0; r < size_; ++r) slots[r] = slot(seq, r);
  read(slots);
}

}  // namespace tp_ext::comm
