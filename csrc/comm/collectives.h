// The collectives every tp_ext communication op is built from. Each takes a resolved Group, waits
// on the backend's work, records accounting under `op`, and never modifies its input.
#pragma once

#include "../common/group.h"
#include "collective_checks.h"

namespace tp_ext::comm {

enum class Reduce { Sum, Avg, Max, Min, Product };
Reduce parse_reduce(c10::string_view reduce, const char* op);

at::Tensor all_reduce(const at::Tensor& x, Reduce reduce, const Group& g, const char* op);
// Concatenates every rank's x along `dim`; `sizes` lists each rank's size there (uneven allowed).
at::Tensor all_gather(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                      const Group& g, const char* op);
// Reduces x over ranks and keeps this rank's piece along `dim` (pieces given by `sizes`).
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                          Reduce reduce, const Group& g, const char* op);
at::Tensor broadcast(const at::Tensor& x, int64_t src, const Group& g, const char* op);
// Splits x along scatter_dim (piece r goes to rank r) and concatenates what arrives along
// gather_dim. Every rank passes a tensor of the same shape.
at::Tensor all_to_all(const at::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                      at::OptionalIntArrayRef sizes, const Group& g, const char* op);
// Uneven all-to-all along dim 0: rows [sum(send[:r]), +send[r]) go to rank r, and recv[r] rows
// arrive from rank r, in rank order. recv[r] must equal rank r's send[me]. Records the bytes sent
// to other ranks (collective "all_to_all_v").
at::Tensor all_to_all_single(const at::Tensor& x, at::IntArrayRef send, at::IntArrayRef recv,
                             const Group& g, const char* op);
// This rank's piece of x along `dim` (no communication); a copy, never a view of x.
at::Tensor local_piece(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                       const Group& g, const char* op);

// ---- asynchronous collectives: start now, finish() later (SUMMA overlaps them with GEMMs) ----
// A collective started by *_start and not finished yet. Until finish() returns, neither `out` nor
// the input passed to *_start may be written, and `out` must not be read. Every rank of the group
// must start the same collectives in the same order (as for the blocking ones) and finish each of
// them; the checks (consistency check, shared-memory signature round) run in *_start, so ranks
// that disagree fail there, before anything is in flight.
struct Pending {
  at::Tensor out;
  c10::intrusive_ptr<c10d::Work> work;  // null: nothing in flight (a group of one, or no data)
  Group g;
  const char* op = "";
  const char* collective = "";
  int64_t bytes = 0;   // what finish() records, as the blocking collective would (stats.h)
  double seconds = 0;  // host time spent in *_start; finish() adds the time it waits
  int64_t root = -1;   // reduce: the rank that receives the result
  Reduce reduce = Reduce::Sum;
};
// Broadcast from group rank `src`: there x is the data; on the other ranks only x's shape and
// dtype count (pass e.g. at::empty of the same shape). On src, out may share x's memory.
Pending broadcast_start(const at::Tensor& x, int64_t src, const Group& g, const char* op);
// Reduce over the group into group rank `root`: after finish(), out holds the reduction there and
// is unspecified on the other ranks. x itself is never modified (the backend works on a copy).
Pending reduce_start(const at::Tensor& x, int64_t root, Reduce reduce, const Group& g,
                     const char* op);
// All-reduce (sum) over the group: after finish(), out holds it on every rank. x itself is never
// modified (the backend works on a copy).
Pending all_reduce_start(const at::Tensor& x, const Group& g, const char* op);
// Waits for the collective (errors name op, rank and group, as wait() does), records it in the
// accounting under the op and its collective, and returns out. Call it once.
at::Tensor finish(Pending& p);

// ---- ring shifts: the point-to-point steps of the ring-decomposed fused ops ----
// One step of a ring: `send` goes to group rank + 1 while `recv` (its shape known on both sides)
// is filled from rank - 1. Empty tensors are not sent (both sides know the sizes). Every rank
// of the group must take the same steps; ring_announce (once per fused call, with the call's
// shapes) makes ranks that disagree fail together instead of hanging.
struct RingShift {
  c10::intrusive_ptr<c10d::Work> send, recv;
};
// x: a tensor of the shape every rank agrees on but for `free_dim` (-1: none); an expanded
// scalar will do.
void ring_announce(const at::Tensor& x, int64_t free_dim, at::IntArrayRef sizes, int64_t kind,
                   const Group& g, const char* op);
RingShift ring_shift_start(const at::Tensor& send, at::Tensor& recv, int64_t step, const Group& g);
// Waits for both transfers (within the collective timeout); returns the seconds it waited.
double ring_shift_finish(RingShift& s, const Group& g, const char* op);

}  // namespace tp_ext::comm
