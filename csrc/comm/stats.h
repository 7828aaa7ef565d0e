// Communication accounting: count, bytes and seconds per (tag, op, collective), recorded by every
// tp_ext collective while tracking is on (tp_ext.comm.track()).
//
// Seconds are host wall-clock time on the calling thread, from just before the transfer (after the
// argument and consistency checks; some copies of the input and output around the backend call are
// included) until the output is ready to return. For gloo and the shared-memory channel (CPU
// tensors) the collective has finished by then, so this is its duration. For NCCL it is not: c10d's
// wait only makes the current CUDA stream wait for the collective, so the seconds are the time to
// enqueue it (and the copies around it) on the GPU, and the transfer may still be running when the
// op returns. Time CUDA collectives with CUDA events or the profiler.
//
// Bytes are what this rank's collective covers, independent of the algorithm: all_reduce,
// broadcast and reduce count the tensor, all_gather the gathered (full) output, reduce_scatter the
// full input, all_to_all the input. With these, an all-gather plus a reduce-scatter of a tensor
// count the same as one all-reduce of it, which is how Megatron's sequence parallelism keeps the
// same volume.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace tp_ext::comm {

using StatRow = std::tuple<std::string, std::string, std::string, int64_t, int64_t, double>;

bool tracking();
void set_tracking(bool on);
void reset_stats();
std::vector<StatRow> stats_snapshot();  // (tag, op, collective, count, bytes, seconds)
void set_tag(const std::string& tag);   // process-wide, so backward (engine threads) sees it too
std::string get_tag();
// Adds one call (no-op while tracking is off); `seconds` as described above.
void record(const char* op, const char* collective, int64_t bytes, double seconds);

}  // namespace tp_ext::comm
