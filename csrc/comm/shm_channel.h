// A shared-memory channel for the ranks of a CPU (gloo) process group that share one host.
//
// Every rank publishes up to slot_bytes() bytes into its own slot of a POSIX shared-memory
// segment, and once all ranks have published, each reads every rank's slot in place. One pass
// through memory replaces gloo's rounds of TCP messages over loopback, so the small collectives
// of tensor and sequence parallelism (activations of a few tokens, norm-weight gradients) take
// microseconds instead of hundreds. Tensors larger than a slot go in rounds (collectives.cpp);
// CUDA tensors, other backends, ranks on several hosts, or TP_EXT_SHM=0 keep using the process
// group itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "../common/group.h"

namespace tp_ext::comm {

class ShmChannel {
 public:
  // The channel of g, set up on first use: a collective over g (every rank must reach it at the
  // same point, as the synchronous collectives do). nullptr where the channel cannot serve g, on
  // every rank alike.
  // Also where bad environment settings (settings.h) are raised, on every rank; `op` names the
  // collective in that error.
  static std::shared_ptr<ShmChannel> of(const Group& g, const char* op);

  // Publishes nbytes (<= slot_bytes()) of data as this rank's slot, waits until every rank has
  // published, then calls read(slots), slots[r] being rank r's bytes. `signature` describes the
  // collective (kind, dtype, shapes every rank agrees on): ranks that publish different ones raise
  // instead of reading each other's bytes. Throws, naming op and the missing rank, when a peer
  // exits or the collective timeout passes; the channel is then unusable.
  void exchange(const void* data, int64_t nbytes, uint64_t signature,
                const std::function<void(const std::vector<const char*>&)>& read, const char* op,
                const Group& g);

  int64_t slot_bytes() const { return slot_bytes_; }

  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;
  ~ShmChannel();

 private:
  ShmChannel(char* base, int64_t mapped_bytes, int64_t rank, int64_t size, int64_t slot_bytes,
             std::vector<int64_t> pids);
  static std::shared_ptr<ShmChannel> create(const Group& g, const char* op);
  void wait_for_all(uint64_t seq, const char* op, const Group& g);
  struct alignas(64) RankLine;  // per rank: arrival counter, signature of its collective
  RankLine& line(int64_t r) const;
  char* slot(uint64_t seq, int64_t r) const;

  char* base_;
  int64_t mapped_bytes_, rank_, size_, slot_bytes_;
  std::vector<int64_t> pids_;  // of every rank, to tell a dead peer from a slow one
  uint64_t seq_ = 0;           // collectives done on this channel (the same on every rank)
  bool broken_ = false;        // after a timeout or a dead peer the ranks are out of step
  std::mutex mu_;
};

// Process-wide switch, read when a group's channel is set up; nullopt (the default) follows
// TP_EXT_SHM. Each rank's choice goes into the setup exchange: off on any rank is off on all.
void set_shm_enabled(c10::optional<bool> on);
// Whether the group with this name has a working channel (false before its first collective).
bool shm_active(c10::string_view group_name);

}  // namespace tp_ext::comm
