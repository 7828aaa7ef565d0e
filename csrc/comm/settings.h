// Every environment variable tp_ext's communication layer reads, parsed and checked in one place.
//
//   TP_EXT_SHM                 1 (default) / 0: the shared-memory channel for same-host gloo groups
//   TP_EXT_SHM_SLOT_BYTES      bytes per rank and round of that channel (4096 .. 1 GiB, a multiple
//                              of 64; default 1 MiB)
//   TP_EXT_CHECK_COLLECTIVES   0 (default) / 1: the cross-rank consistency check of every call
//   TP_EXT_TEST_DIE_IN_SHM_SETUP  test-only: rank 0 kills itself at a point of the channel setup
//                              ("created" or "mapped"), so tests can check that no segment is left
//
// Booleans accept 1/0, true/false, on/off, yes/no. A bad value is never silently replaced by a
// default: settings_error() names it, and the first collective of a group raises it on every rank
// (the setup exchange carries each rank's verdict).
#pragma once

#include <cstdint>
#include <string>

namespace tp_ext::comm {

constexpr int64_t kDefaultSlotBytes = int64_t(1) << 20;
constexpr int64_t kMinSlotBytes = 4096;
constexpr int64_t kMaxSlotBytes = int64_t(1) << 30;

struct EnvSettings {
  bool shm = true;
  int64_t slot_bytes = kDefaultSlotBytes;
  bool checks = false;
  std::string error;  // empty when every variable is valid; else one line per bad variable
  int64_t bad = 0;    // bit per bad variable: 1 TP_EXT_SHM, 2 _SLOT_BYTES, 4 _CHECK_COLLECTIVES
};

// Reads the variables now (tests change them per rank before a group's first collective).
EnvSettings read_env();

// The names (and what is allowed) of the variables in `bad`, for the ranks whose own are fine.
std::string describe_bad(int64_t bad);

// The test-only hook above: the stage named by TP_EXT_TEST_DIE_IN_SHM_SETUP, or "".
std::string test_die_stage();

}  // namespace tp_ext::comm
