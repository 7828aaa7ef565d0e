// The one group resolver: a process group named by `group_name` (c10d's registry), checked against
// the size (and rank) the caller passed. Used by the collectives and by ops that communicate.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>

namespace tp_ext {

// A process group found in c10d's registry, already checked against the size the caller passed.
struct Group {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::string name;
  int64_t rank;
  int64_t size;
};

// Finds `group_name` in c10d's registry and checks that it has `group_size` ranks, that this
// process is rank `group_rank` of it (when given, >= 0) and that it has a backend for `device`.
// `op` names the calling op in error messages.
Group resolve_group(c10::string_view group_name, int64_t group_size, const at::Device& device,
                    const char* op, int64_t group_rank = -1);

}  // namespace tp_ext
