// What every collective does around its backend call: per-rank sizes from the `sizes` argument,
// the opt-in cross-rank consistency check, the collective timeout and the wait on c10d's work.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <initializer_list>
#include <vector>

#include "../common/group.h"

namespace tp_ext::comm {

// Timeout applied to every tp_ext collective; 0 means the group's own timeout (the one given to
// init_process_group / tp_ext.init_parallel).
void set_timeout_ms(int64_t ms);
int64_t timeout_ms();
// Goes into each collective's options; c10d's "unset" when the timeout is 0.
std::chrono::milliseconds op_timeout();
// work->wait(), with errors that name the op, the rank and the group. On gloo (CPU) this blocks
// until the collective is done; on NCCL it makes the current CUDA stream wait for the collective
// and returns without blocking the host (unless the process group is set up for blocking waits).
void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* op, const Group& g);

// Opt-in (TP_EXT_CHECK_COLLECTIVES=1 or tp_ext.comm.set_consistency_checks(True)): before each
// collective, all ranks exchange the op, dtype and shape and raise the same clear error when they
// disagree, instead of hanging or reading garbage.
// nullopt: follow TP_EXT_CHECK_COLLECTIVES again.
void set_consistency_checks(c10::optional<bool> on);
bool consistency_checks();
// `free_dim` (>= 0) is a dimension that may legitimately differ between ranks (uneven gathers);
// `sizes` and `extra` (the op's other arguments: dim, reduce, src) must match on every rank.
void check_consistent(const Group& g, const char* op, const at::Tensor& x, int64_t free_dim,
                      at::OptionalIntArrayRef sizes, int64_t extra);

// What to add to a "ranks called different collectives" error of `op`: for the sequence gathers
// (gather_from_sp, all_gather_linear), the likeliest cause, shards of unequal length without
// `sizes`; "" for the other ops.
const char* mismatch_hint(const char* op);

// A hash of everything every rank must agree on for one call: the kind of collective, dtype,
// shape (a free dimension given as -2), the sizes list and other arguments. The shared-memory
// channel compares it at every round (always on, no extra communication).
uint64_t call_signature(int64_t kind, at::ScalarType dtype, at::IntArrayRef shape,
                        at::IntArrayRef sizes, std::initializer_list<int64_t> args);

// Per-rank sizes along a dimension, from the optional `sizes` argument.
//   for_full_input=true: x holds the whole dimension (scatter / reduce-scatter); sum(sizes) must
//   equal x.size(dim), and without `sizes` the dimension must divide evenly.
//   for_full_input=false: x holds this rank's piece (gather); sizes[rank] must equal x.size(dim),
//   and without `sizes` every rank is assumed to hold x.size(dim).
std::vector<int64_t> rank_sizes(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                                const Group& g, bool for_full_input, const char* op);

}  // namespace tp_ext::comm
