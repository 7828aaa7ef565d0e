#include "group.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace tp_ext {

Group resolve_group(c10::string_view group_name, int64_t group_size, const at::Device& device,
                    const char* op, int64_t group_rank) {
  std::string name(group_name);
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    TORCH_CHECK_VALUE(
        false, "tp_ext.", op, ": unknown process group name group_name='", name,
        "'. Pass the group_name of a live group (e.g. tp_ext.init_parallel(...).tp_group"
        ".group_name, or dist.group.WORLD.group_name) after init_process_group.");
  }
  TORCH_CHECK_VALUE(group_size == pg->getSize(), "tp_ext.", op, ": group_size=", group_size,
                    " but process group '", name, "' has ", pg->getSize(),
                    " ranks; pass group_size=", pg->getSize(), ".");
  TORCH_CHECK_VALUE(group_rank < 0 || group_rank == pg->getRank(), "tp_ext.", op,
                    ": group_rank=", group_rank, " but this process is rank ", pg->getRank(),
                    " of process group '", name,
                    "'; pass group_rank=group.rank() (a traced graph is specific to the rank "
                    "that traced it).");
  try {
    pg->getBackend(device.type());
  } catch (const std::exception&) {
    TORCH_CHECK_VALUE(false, "tp_ext.", op, ": process group '", name,
                      "' has no backend for tensors on ", device,
                      "; move the tensor to a device the group serves (gloo: cpu; nccl: cuda) or "
                      "create the group with a backend for ",
                      device.type(), ".");
  }
  return Group{pg, name, pg->getRank(), pg->getSize()};
}

}  // namespace tp_ext
