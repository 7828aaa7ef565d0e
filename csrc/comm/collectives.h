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
// This rank's piece of x along `dim` (no communication); a copy, never a view of x.
at::Tensor local_piece(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                       const Group& g, const char* op);

}  // namespace tp_ext::comm
