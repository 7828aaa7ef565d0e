#include "collectives.h"

#include <chrono>
#include <cstring>
#include <sstream>

#include "../common/checks.h"
#include "shm_channel.h"
#include "stats.h"

namespace tp_ext::comm {

namespace {

using Clock = std::chrono::steady_clock;

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Host time since t0, as recorded in the accounting: the collective's duration on gloo and the
// shared-memory channel, only the time to enqueue it on NCCL (stats.h).
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

c10d::ReduceOp to_c10d(Reduce r) {
  switch (r) {
    case Reduce::Sum:
    case Reduce::Avg:  // gloo has no AVG: sum, then divide (same result on every backend)
      return c10d::ReduceOp::SUM;
    case Reduce::Max:
      return c10d::ReduceOp::MAX;
    case Reduce::Min:
      return c10d::ReduceOp::MIN;
    case Reduce::Product:
      return c10d::ReduceOp::PRODUCT;
  }
  return c10d::ReduceOp::SUM;
}

void finish_avg(at::Tensor& t, Reduce r, const Group& g) {
  if (r == Reduce::Avg) t.div_(g.size);
}

void check_avg_dtype(const at::Tensor& x, Reduce r, const char* op) {
  TORCH_CHECK_VALUE(
      r != Reduce::Avg || at::isFloatingType(x.scalar_type()) || at::isComplexType(x.scalar_type()),
      "tp_ext.", op, ": reduce='avg' needs a floating-point tensor, got ", x.scalar_type(),
      "; use reduce='sum' and divide, or convert x to float.");
}

// x with `dim` moved to the front, contiguous; every collective below works on dim 0.
at::Tensor dim_to_front(const at::Tensor& x, int64_t dim) {
  return (dim == 0 ? x : x.movedim(dim, 0)).contiguous();
}

std::vector<int64_t> with_first(at::IntArrayRef shape, int64_t first) {
  auto v = shape.vec();
  v[0] = first;
  return v;
}

// ---- the shared-memory path (shm_channel.h) for CPU tensors of same-host gloo groups ----

bool shm_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// The group's channel, set up at its first CPU collective of any kind (so every rank sets it up
// at the same call), or nullptr. Every collective of a group with a channel passes a round
// through it with its call signature, so ranks that disagree (sizes, shape, dim, dtype, op) raise
// together instead of reaching gloo with mismatched sizes (which aborts the process) or hanging.
std::shared_ptr<ShmChannel> channel_of(const at::Tensor& x, const Group& g, const char* op) {
  return x.device().is_cpu() ? ShmChannel::of(g, op) : nullptr;
}

// Whether the payload itself goes through the channel: decided from what the signature covers
// (dtype, the smallest unit a round must carry: an element, or one row of an all-gather), so all
// ranks that passed the signature check take the same path. Larger tensors go in rounds.
bool payload_fits(const std::shared_ptr<ShmChannel>& shm, const at::Tensor& x, int64_t unit_bytes) {
  return shm && shm_dtype(x.scalar_type()) && unit_bytes <= shm->slot_bytes();
}

// The signature of round `start` of a call.
uint64_t round_sig(uint64_t call, int64_t start) {
  return (call ^ static_cast<uint64_t>(start)) * 1099511628211ull;
}

// A call whose payload goes through the process group: one empty round first, so ranks that
// disagree fail together on the signature.
void announce(const std::shared_ptr<ShmChannel>& shm, uint64_t sig, const char* op,
              const Group& g) {
  if (shm) shm->exchange(nullptr, 0, sig, [](const std::vector<const char*>&) {}, op, g);
}

// x's shape with `free_dim` (a dimension that may differ between ranks) as -2.
std::vector<int64_t> fixed_shape(const at::Tensor& x, int64_t free_dim) {
  auto v = x.sizes().vec();
  if (free_dim >= 0) v[free_dim] = -2;
  return v;
}

// Reduces dst.numel() elements at byte `offset` of every slot into dst (contiguous), in rank
// order, so every rank that reduces the same elements gets bitwise the same result; bf16/fp16
// sums and averages are accumulated, and averages divided, in fp32 and rounded once.
void reduce_slots_into(at::Tensor dst, const std::vector<const char*>& slots, int64_t offset,
                       Reduce reduce) {
  auto piece = [&](size_t r) {
    return at::from_blob(const_cast<char*>(slots[r]) + offset, {dst.numel()}, dst.options());
  };
  const bool widen = (reduce == Reduce::Sum || reduce == Reduce::Avg) &&
                     at::isReducedFloatingType(dst.scalar_type());
  at::Tensor acc = widen ? piece(0).to(at::kFloat) : dst.copy_(piece(0));
  for (size_t r = 1; r < slots.size(); ++r) {
    const at::Tensor next = piece(r);
    switch (reduce) {
      case Reduce::Sum:
      case Reduce::Avg:
        acc.add_(next);
        break;
      case Reduce::Max:
        at::maximum_out(acc, acc, next);
        break;
      case Reduce::Min:
        at::minimum_out(acc, acc, next);
        break;
      case Reduce::Product:
        acc.mul_(next);
        break;
    }
  }
  if (reduce == Reduce::Avg) acc.div_(static_cast<int64_t>(slots.size()));
  if (widen) dst.copy_(acc);
}

}  // namespace

Reduce parse_reduce(c10::string_view reduce, const char* op) {
  if (reduce == "sum") return Reduce::Sum;
  if (reduce == "avg") return Reduce::Avg;
  if (reduce == "max") return Reduce::Max;
  if (reduce == "min") return Reduce::Min;
  if (reduce == "product") return Reduce::Product;
  TORCH_CHECK_VALUE(false, "tp_ext.", op, ": reduce='", std::string(reduce),
                    "' is not supported; use one of 'sum', 'avg', 'max', 'min', 'product'.");
}

at::Tensor all_reduce(const at::Tensor& x, Reduce reduce, const Group& g, const char* op) {
  check_tensor(x, "x", op);
  check_avg_dtype(x, reduce, op);
  if (g.size == 1) return x.clone(at::MemoryFormat::Contiguous);
  const auto shm = channel_of(x, g, op);
  check_consistent(g, op, x, -1, c10::nullopt, static_cast<int64_t>(reduce));
  const auto call =
      call_signature(1, x.scalar_type(), x.sizes(), {}, {static_cast<int64_t>(reduce)});
  auto t0 = Clock::now();
  at::Tensor out;
  if (payload_fits(shm, x, x.element_size())) {
    // In rounds of one slot: publish a piece of x, reduce every rank's piece into out.
    const auto src = x.contiguous();
    out = at::empty(src.sizes(), src.options());
    const int64_t esize = x.element_size(), per_round = shm->slot_bytes() / esize;
    auto flat = out.view({-1});
    for (int64_t start = 0; start < flat.numel(); start += per_round) {
      const int64_t count = std::min(per_round, flat.numel() - start);
      shm->exchange(static_cast<const char*>(src.const_data_ptr()) + start * esize, count * esize,
                    round_sig(call, start), [&](const std::vector<const char*>& slots) {
        reduce_slots_into(flat.narrow(0, start, count), slots, 0, reduce);
      }, op, g);
    }
  } else {
    announce(shm, call, op, g);
    out = x.clone(at::MemoryFormat::Contiguous);
    std::vector<at::Tensor> bufs{out};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(reduce);
    opts.timeout = op_timeout();
    wait(g.pg->allreduce(bufs, opts), op, g);
    finish_avg(out, reduce, g);
  }
  record(op, "all_reduce", nbytes(out), seconds_since(t0));
  return out;
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                      const Group& g, const char* op) {
  check_tensor(x, "x", op);
  dim = wrap_dim(dim, x.dim(), "dim", op);
  const auto per_rank = rank_sizes(x, dim, sizes, g, /*for_full_input=*/false, op);
  if (g.size == 1) return x.clone(at::MemoryFormat::Contiguous);
  const auto shm = channel_of(x, g, op);
  // Each rank's size along dim is in per_rank, so that dim may differ between ranks.
  check_consistent(g, op, x, dim, per_rank, dim);
  const auto call = call_signature(2, x.scalar_type(), fixed_shape(x, dim), per_rank, {dim});
  const int64_t widest = *std::max_element(per_rank.begin(), per_rank.end());
  const bool even =
      std::all_of(per_rank.begin(), per_rank.end(), [&](int64_t s) { return s == widest; });
  auto front = dim_to_front(x, dim);
  const int64_t row_bytes = front.size(0) > 0 ? nbytes(front) / front.size(0)
                                              : c10::multiply_integers(front.sizes().slice(1)) *
                                                    static_cast<int64_t>(x.element_size());
  if (payload_fits(shm, x, row_bytes)) {
    // In rounds: each rank publishes up to a slot's worth of its rows (none once it has sent
    // them all); every rank copies each piece to that rank's place in the output.
    auto t0 = Clock::now();
    std::vector<int64_t> first_row(g.size, 0);
    for (int64_t r = 1; r < g.size; ++r) first_row[r] = first_row[r - 1] + per_rank[r - 1];
    auto gathered =
        at::empty(with_first(front.sizes(), first_row.back() + per_rank.back()), front.options());
    const int64_t rows_per_round = row_bytes > 0 ? shm->slot_bytes() / row_bytes : widest;
    char* dst = static_cast<char*>(gathered.data_ptr());
    const char* src = static_cast<const char*>(front.const_data_ptr());
    for (int64_t done = 0; done == 0 || done < widest; done += rows_per_round) {
      auto rows_of = [&](int64_t r) {
        return std::max<int64_t>(0, std::min(rows_per_round, per_rank[r] - done));
      };
      shm->exchange(src + done * row_bytes, rows_of(g.rank) * row_bytes, round_sig(call, done),
                    [&](const std::vector<const char*>& slots) {
        for (int64_t r = 0; r < g.size; ++r)
          if (rows_of(r) * row_bytes > 0)
            std::memcpy(dst + (first_row[r] + done) * row_bytes, slots[r], rows_of(r) * row_bytes);
      }, op, g);
      if (rows_per_round == 0) break;
    }
    auto out = dim == 0 ? gathered : gathered.movedim(0, dim).contiguous();
    record(op, "all_gather", nbytes(out), seconds_since(t0));
    return out;
  }
  announce(shm, call, op, g);
  // Gather equal-sized slots (padding short pieces) so every backend can do it in one call.
  if (front.size(0) < widest) {
    auto padded = at::zeros(with_first(front.sizes(), widest), front.options());
    padded.narrow(0, 0, front.size(0)).copy_(front);
    front = padded;
  }
  auto slots = at::empty(with_first(front.sizes(), widest * g.size), front.options());
  auto t0 = Clock::now();
  if (slots.numel() > 0) {
    c10d::AllgatherOptions opts;
    opts.timeout = op_timeout();
    wait(g.pg->_allgather_base(slots, front, opts), op, g);
  }
  at::Tensor gathered = slots;
  if (!even) {
    std::vector<at::Tensor> pieces;
    for (int64_t r = 0; r < g.size; ++r) pieces.push_back(slots.narrow(0, r * widest, per_rank[r]));
    gathered = at::cat(pieces, 0);
  }
  auto out = dim == 0 ? gathered : gathered.movedim(0, dim).contiguous();
  record(op, "all_gather", nbytes(out), seconds_since(t0));
  return out;
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                          Reduce reduce, const Group& g, const char* op) {
  check_tensor(x, "x", op);
  check_avg_dtype(x, reduce, op);
  dim = wrap_dim(dim, x.dim(), "dim", op);
  const auto per_rank = rank_sizes(x, dim, sizes, g, /*for_full_input=*/true, op);
  if (g.size == 1) return x.clone(at::MemoryFormat::Contiguous);
  const auto shm = channel_of(x, g, op);
  check_consistent(g, op, x, -1, per_rank, dim * 8 + static_cast<int64_t>(reduce));
  const auto call =
      call_signature(3, x.scalar_type(), x.sizes(), per_rank, {dim, static_cast<int64_t>(reduce)});
  const int64_t widest = *std::max_element(per_rank.begin(), per_rank.end());
  const bool even =
      std::all_of(per_rank.begin(), per_rank.end(), [&](int64_t s) { return s == widest; });
  auto front = dim_to_front(x, dim);
  if (payload_fits(shm, x, x.element_size())) {
    // In rounds over the whole of x, a slot's worth at a time: every rank publishes that range,
    // and each reduces the part of it that falls in its own piece.
    auto t0 = Clock::now();
    const int64_t esize = x.element_size(), per_round = shm->slot_bytes() / esize;
    const int64_t row = front.size(0) > 0 ? front.numel() / front.size(0) : 0;
    int64_t offset = 0;
    for (int64_t r = 0; r < g.rank; ++r) offset += per_rank[r];
    const int64_t mine_begin = offset * row, mine_end = (offset + per_rank[g.rank]) * row;
    auto mine = at::empty(with_first(front.sizes(), per_rank[g.rank]), front.options());
    auto mine_flat = mine.view({-1});
    const char* src = static_cast<const char*>(front.const_data_ptr());
    for (int64_t start = 0; start == 0 || start < front.numel(); start += per_round) {
      const int64_t count = std::min(per_round, front.numel() - start);
      shm->exchange(src + start * esize, count * esize, round_sig(call, start),
                    [&](const std::vector<const char*>& slots) {
        const int64_t lo = std::max(start, mine_begin), hi = std::min(start + count, mine_end);
        if (lo < hi)
          reduce_slots_into(mine_flat.narrow(0, lo - mine_begin, hi - lo), slots,
                            (lo - start) * esize, reduce);
      }, op, g);
    }
    auto out = (dim == 0 ? mine : mine.movedim(0, dim)).contiguous();
    record(op, "reduce_scatter", nbytes(x), seconds_since(t0));
    return out;
  }
  announce(shm, call, op, g);
  at::Tensor slots = front;
  if (!even) {  // lay each rank's piece into an equal-sized slot (padding is never read back)
    slots = at::zeros(with_first(front.sizes(), widest * g.size), front.options());
    int64_t offset = 0;
    for (int64_t r = 0; r < g.size; ++r) {
      slots.narrow(0, r * widest, per_rank[r]).copy_(front.narrow(0, offset, per_rank[r]));
      offset += per_rank[r];
    }
  }
  auto mine = at::empty(with_first(front.sizes(), widest), front.options());
  auto t0 = Clock::now();
  if (slots.numel() > 0) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(reduce);
    opts.timeout = op_timeout();
    wait(g.pg->_reduce_scatter_base(mine, slots, opts), op, g);
  }
  auto out = mine.narrow(0, 0, per_rank[g.rank]);
  out = (dim == 0 ? out : out.movedim(0, dim)).contiguous();
  finish_avg(out, reduce, g);
  record(op, "reduce_scatter", nbytes(x), seconds_since(t0));
  return out;
}

at::Tensor broadcast(const at::Tensor& x, int64_t src, const Group& g, const char* op) {
  check_tensor(x, "x", op);
  TORCH_CHECK_VALUE(src >= 0 && src < g.size, "tp_ext.", op, ": src=", src,
                    " is not a rank of group '", g.name, "'; use a group rank in [0, ", g.size - 1,
                    "].");
  auto out = x.clone(at::MemoryFormat::Contiguous);
  if (g.size == 1) return out;
  const auto shm = channel_of(x, g, op);
  check_consistent(g, op, x, -1, c10::nullopt, src);
  announce(shm, call_signature(4, x.scalar_type(), x.sizes(), {}, {src}), op, g);
  auto t0 = Clock::now();
  std::vector<at::Tensor> bufs{out};
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  opts.timeout = op_timeout();
  wait(g.pg->broadcast(bufs, opts), op, g);
  record(op, "broadcast", nbytes(out), seconds_since(t0));
  return out;
}

at::Tensor all_to_all(const at::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                      at::OptionalIntArrayRef sizes, const Group& g, const char* op) {
  check_tensor(x, "x", op);
  scatter_dim = wrap_dim(scatter_dim, x.dim(), "scatter_dim", op);
  gather_dim = wrap_dim(gather_dim, x.dim(), "gather_dim", op);
  const auto send = rank_sizes(x, scatter_dim, sizes, g, /*for_full_input=*/true, op);
  if (g.size == 1) return x.clone(at::MemoryFormat::Contiguous);
  const auto shm = channel_of(x, g, op);
  check_consistent(g, op, x, -1, send, scatter_dim * 64 + gather_dim);
  announce(shm, call_signature(5, x.scalar_type(), x.sizes(), send, {scatter_dim, gather_dim}), op,
           g);
  auto front = dim_to_front(x, scatter_dim);
  const int64_t mine = send[g.rank];  // every rank sends me a piece of this size
  auto recv = at::empty(with_first(front.sizes(), mine * g.size), front.options());
  std::vector<int64_t> recv_splits(g.size, mine);
  std::vector<int64_t> send_splits = send;
  auto t0 = Clock::now();
  c10d::AllToAllOptions opts;
  opts.timeout = op_timeout();
  wait(g.pg->alltoall_base(recv, front, recv_splits, send_splits, opts), op, g);
  std::vector<at::Tensor> pieces;
  for (int64_t r = 0; r < g.size; ++r) {
    auto piece = recv.narrow(0, r * mine, mine);
    pieces.push_back(scatter_dim == 0 ? piece : piece.movedim(0, scatter_dim));
  }
  auto out = at::cat(pieces, gather_dim);
  record(op, "all_to_all", nbytes(x), seconds_since(t0));
  return out;
}

namespace {

// What each rank contributes to the sizes round: a flag (1: its arguments are bad, see its own
// error), then its n send sizes and n receive sizes (zeros where it gave the wrong count).
std::vector<int64_t> sizes_row(at::IntArrayRef send, at::IntArrayRef recv, bool bad, int64_t n) {
  std::vector<int64_t> row(2 * n + 1, 0);
  row[0] = bad ? 1 : 0;
  for (int64_t r = 0; r < n && !bad; ++r) row[1 + r] = send[r], row[1 + n + r] = recv[r];
  return row;
}

// Every rank's row of the sizes round (n rows of 2n + 1): all ranks raise together when any
// rank's arguments are bad (that rank with its own message) or when any pair disagrees (what
// rank j expects from rank i must be what rank i sends it); otherwise gloo would abort or read
// garbage, and the ranks that passed their local checks would wait for the others.
void check_sizes_table(const std::vector<int64_t>& table, const std::string& my_error,
                       const Group& g, const char* op) {
  const int64_t n = g.size, w = 2 * n + 1;
  TORCH_CHECK_VALUE(my_error.empty(), my_error);
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK_VALUE(table[r * w] == 0, "tp_ext.", op, ": rank ", r, " of process group '", g.name,
                      "' passed bad sizes (its own error says which); every rank stops.");
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const int64_t sends = table[i * w + 1 + j], expects = table[j * w + 1 + n + i];
      TORCH_CHECK_VALUE(sends == expects, "tp_ext.", op, ": rank ", j, " of process group '",
                        g.name, "' expects ", expects, " rows from rank ", i, ", which sends it ",
                        sends,
                        "; recv_sizes[r] must equal rank r's send_sizes[me] (exchange the "
                        "counts first).");
    }
}

// The sizes round over the process group, under the consistency check (the shared-memory path
// has its own, always).
void check_pairwise_sizes(const Group& g, const char* op, at::IntArrayRef send,
                          at::IntArrayRef recv, const std::string& my_error) {
  if (!consistency_checks()) {
    TORCH_CHECK_VALUE(my_error.empty(), my_error);  // the others fail at the collective timeout
    return;
  }
  const int64_t n = g.size;
  auto mine =
      at::tensor(sizes_row(send, recv, !my_error.empty(), n), at::TensorOptions().dtype(at::kLong));
  auto all = at::empty({n * (2 * n + 1)}, mine.options());
  c10d::AllgatherOptions opts;
  opts.timeout = op_timeout();
  wait(g.pg->_allgather_base(all, mine, opts), op, g);
  const auto* p = all.const_data_ptr<int64_t>();
  check_sizes_table(std::vector<int64_t>(p, p + all.numel()), my_error, g, op);
}

// all_to_all_single through the shared-memory channel. A first round publishes every rank's send
// and receive sizes: each rank learns where its rows sit in every sender's buffer, and all ranks
// check every pair alike (so they raise together). Then each rank publishes its buffer a slot at a
// time, and every rank copies out only the rows meant for it.
void all_to_all_single_shm(ShmChannel& shm, const at::Tensor& x, at::IntArrayRef send,
                           at::IntArrayRef recv, const std::string& my_error, int64_t row_bytes,
                           uint64_t call, at::Tensor& out, const Group& g, const char* op) {
  auto t0 = Clock::now();
  const int64_t n = g.size, me = g.rank, w = 2 * n + 1;
  const auto mine = sizes_row(send, recv, !my_error.empty(), n);
  std::vector<int64_t> table(n * w);
  shm.exchange(mine.data(), w * 8, round_sig(call, -1), [&](const std::vector<const char*>& slots) {
    for (int64_t r = 0; r < n; ++r) std::memcpy(&table[r * w], slots[r], w * 8);
  }, op, g);
  check_sizes_table(table, my_error, g, op);
  auto sends = [&](int64_t from, int64_t to) { return table[from * w + 1 + to]; };
  std::vector<int64_t> start_in(n, 0), out_start(n, 0);  // my rows in sender s; s's rows in out
  int64_t widest = 0;
  for (int64_t s = 0; s < n; ++s) {
    int64_t total = 0;
    for (int64_t d = 0; d < n; ++d) {
      if (d == me) start_in[s] = total;
      total += sends(s, d);
    }
    widest = std::max(widest, total);
    if (s > 0) out_start[s] = out_start[s - 1] + recv[s - 1];
  }
  const int64_t rows_per_round = row_bytes > 0 ? shm.slot_bytes() / row_bytes : widest;
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t sent = x.size(0);
  for (int64_t done = 0; done == 0 || done < widest; done += rows_per_round) {
    const int64_t publish = std::max<int64_t>(0, std::min(rows_per_round, sent - done));
    shm.exchange(src + done * row_bytes, publish * row_bytes, round_sig(call, done),
                 [&](const std::vector<const char*>& slots) {
      for (int64_t s = 0; s < n; ++s) {
        const int64_t lo = std::max(done, start_in[s]);
        const int64_t hi = std::min(done + rows_per_round, start_in[s] + sends(s, me));
        if (hi > lo)
          std::memcpy(dst + (out_start[s] + lo - start_in[s]) * row_bytes,
                      slots[s] + (lo - done) * row_bytes, (hi - lo) * row_bytes);
      }
    }, op, g);
    if (rows_per_round == 0) break;
  }
  record(op, "all_to_all_v", (sent - send[me]) * row_bytes, seconds_since(t0));
}

}  // namespace

// The size arguments' problems on this rank ("" when none), raised by every rank together.
static std::string size_errors(const at::Tensor& x, at::IntArrayRef send, at::IntArrayRef recv,
                               const Group& g, const char* op) {
  std::ostringstream e;
  for (const auto& [name, sizes] : {std::pair{"send_sizes", send}, std::pair{"recv_sizes", recv}}) {
    if (static_cast<int64_t>(sizes.size()) != g.size) {
      e << "tp_ext." << op << ": " << name << " has " << sizes.size() << " entries ("
        << shape_str(sizes) << ") but group '" << g.name << "' has " << g.size
        << " ranks; give one size per rank.";
      return e.str();
    }
    for (int64_t v : sizes)
      if (v < 0) {
        e << "tp_ext." << op << ": " << name << "=" << shape_str(sizes)
          << " has a negative size; sizes are row counts (>= 0).";
        return e.str();
      }
  }
  int64_t sent = 0;
  for (int64_t v : send) sent += v;
  if (sent != x.size(0))
    e << "tp_ext." << op << ": send_sizes=" << shape_str(send) << " add up to " << sent
      << " but x has " << x.size(0) << " rows (shape " << shape_str(x.sizes())
      << "); they must add up to x.size(0).";
  return e.str();
}

at::Tensor all_to_all_single(const at::Tensor& x, at::IntArrayRef send, at::IntArrayRef recv,
                             const Group& g, const char* op) {
  check_tensor(x, "x", op);
  TORCH_CHECK_VALUE(x.dim() >= 1, "tp_ext.", op, ": x must have at least one dimension (rows).");
  const std::string my_error = size_errors(x, send, recv, g, op);
  auto xc = x.contiguous();
  if (g.size == 1) {
    TORCH_CHECK_VALUE(my_error.empty(), my_error);
    TORCH_CHECK_VALUE(send[0] == recv[0], "tp_ext.", op, ": a group of one sends ", send[0],
                      " rows to itself but expects ", recv[0], "; they must be equal.");
    return xc.clone();
  }
  int64_t received = 0;
  if (my_error.empty())
    for (int64_t v : recv) received += v;
  auto out = at::empty(with_first(xc.sizes(), received), xc.options());
  const auto shm = channel_of(xc, g, op);
  check_consistent(g, op, xc, 0, c10::nullopt, 6);
  int64_t row_bytes = xc.element_size();
  for (int64_t d = 1; d < xc.dim(); ++d) row_bytes *= xc.size(d);
  const auto call = call_signature(6, xc.scalar_type(), fixed_shape(xc, 0), {}, {});
  if (payload_fits(shm, xc, row_bytes) && shm->slot_bytes() >= (2 * g.size + 1) * 8) {
    all_to_all_single_shm(*shm, xc, send, recv, my_error, row_bytes, call, out, g, op);
    return out;
  }
  check_pairwise_sizes(g, op, send, recv, my_error);
  announce(shm, call, op, g);
  auto t0 = Clock::now();
  std::vector<int64_t> send_splits = send.vec(), recv_splits = recv.vec();
  c10d::AllToAllOptions opts;
  opts.timeout = op_timeout();
  wait(g.pg->alltoall_base(out, xc, recv_splits, send_splits, opts), op, g);
  // The traffic itself: what this rank sends to the others (its own rows never leave it).
  record(op, "all_to_all_v", (xc.size(0) - send[g.rank]) * row_bytes, seconds_since(t0));
  return out;
}

at::Tensor local_piece(const at::Tensor& x, int64_t dim, at::OptionalIntArrayRef sizes,
                       const Group& g, const char* op) {
  check_tensor(x, "x", op);
  dim = wrap_dim(dim, x.dim(), "dim", op);
  const auto per_rank = rank_sizes(x, dim, sizes, g, /*for_full_input=*/true, op);
  int64_t offset = 0;
  for (int64_t r = 0; r < g.rank; ++r) offset += per_rank[r];
  return x.narrow(dim, offset, per_rank[g.rank]).clone(at::MemoryFormat::Contiguous);
}

// ---- asynchronous collectives ----
//
// *_start checks and announces synchronously, as the blocking broadcast does (the consistency
// check when on, the shared-memory signature round when the group has a channel: both are
// blocking rounds over the group); only the transfer is left in flight, and finish() blocks until
// every member has started it. Interleaving groups (SUMMA: row, column, row, ...) cannot deadlock
// as long as all ranks issue their starts and finishes in one common program order (each rank
// doing the steps of the groups it is in). Take the blocked rank whose step s comes first in
// that order. No member of s's group is at an earlier step, and none can be past s (a round needs
// every member; a finish follows its start), so all of them reach s and it completes: no cycle of
// waits. In flight, gloo matches one group's collectives by issue order and works on them in
// that order on every rank; NCCL runs them in order on the group's stream.

Pending broadcast_start(const at::Tensor& x, int64_t src, const Group& g, const char* op) {
  check_tensor(x, "x", op);
  TORCH_CHECK_VALUE(src >= 0 && src < g.size, "tp_ext.", op, ": src=", src,
                    " is not a rank of group '", g.name, "'; use a group rank in [0, ", g.size - 1,
                    "].");
  Pending p;
  p.g = g;
  p.op = op;
  p.collective = "broadcast";
  p.root = src;
  if (g.size == 1) {
    p.out = x.contiguous();
    return p;
  }
  const auto shm = channel_of(x, g, op);
  check_consistent(g, op, x, -1, c10::nullopt, src);
  announce(shm, call_signature(4, x.scalar_type(), x.sizes(), {}, {src}), op, g);
  auto t0 = Clock::now();
  p.out = g.rank == src ? x.contiguous() : at::empty(x.sizes(), x.options());
  p.bytes = nbytes(p.out);
  if (p.out.numel() > 0) {  // the same on every rank: the shape was checked above
    std::vector<at::Tensor> bufs{p.out};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    opts.timeout = op_timeout();
    p.work = g.pg->broadcast(bufs, opts);
  }
  p.seconds = seconds_since(t0);
  return p;
}

Pending reduce_start(const at::Tensor& x, int64_t root, Reduce reduce, const Group& g,
                     const char* op) {
  check_tensor(x, "x", op);
  check_avg_dtype(x, reduce, op);
  TORCH_CHECK_VALUE(root >= 0 && root < g.size, "tp_ext.", op, ": root=", root,
                    " is not a rank of group '", g.name, "'; use a group rank in [0, ", g.size - 1,
                    "].");
  Pending p;
  p.g = g;
  p.op = op;
  p.collective = "reduce";
  p.root = root;
  p.reduce = reduce;
  // A copy: the backend may use every rank's buffer as scratch space.
  p.out = x.clone(at::MemoryFormat::Contiguous);
  if (g.size == 1) return p;
  const auto shm = channel_of(x, g, op);
  check_consistent(g, op, x, -1, c10::nullopt, root * 8 + static_cast<int64_t>(reduce));
  announce(shm,
           call_signature(6, x.scalar_type(), x.sizes(), {}, {root, static_cast<int64_t>(reduce)}),
           op, g);
  auto t0 = Clock::now();
  p.bytes = nbytes(p.out);
  if (p.out.numel() > 0) {
    std::vector<at::Tensor> bufs{p.out};
    c10d::ReduceOptions opts;
    opts.reduceOp = to_c10d(reduce);
    opts.rootRank = root;
    opts.rootTensor = 0;
    opts.timeout = op_timeout();
    p.work = g.pg->reduce(bufs, opts);
  }
  p.seconds = seconds_since(t0);
  return p;
}

Pending all_reduce_start(const at::Tensor& x, const Group& g, const char* op) {
  check_tensor(x, "x", op);
  Pending p;
  p.g = g;
  p.op = op;
  p.collective = "all_reduce";
  p.out = x.clone(at::MemoryFormat::Contiguous);
  if (g.size == 1) return p;
  const auto shm = channel_of(x, g, op);
  check_consistent(g, op, x, -1, c10::nullopt, static_cast<int64_t>(Reduce::Sum));
  announce(shm, call_signature(1, x.scalar_type(), x.sizes(), {}, {0}), op, g);
  auto t0 = Clock::now();
  p.bytes = nbytes(p.out);
  if (p.out.numel() > 0) {
    std::vector<at::Tensor> bufs{p.out};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(Reduce::Sum);
    opts.timeout = op_timeout();
    p.work = g.pg->allreduce(bufs, opts);
  }
  p.seconds = seconds_since(t0);
  return p;
}

void ring_announce(const at::Tensor& x, int64_t free_dim, at::IntArrayRef sizes, int64_t kind,
                   const Group& g, const char* op) {
  if (g.size == 1) return;
  check_consistent(g, op, x, free_dim, sizes, kind);
  announce(channel_of(x, g, op),
           call_signature(7, x.scalar_type(), fixed_shape(x, free_dim), sizes, {kind}), op, g);
}

RingShift ring_shift_start(const at::Tensor& send, at::Tensor& recv, int64_t step, const Group& g) {
  // NCCL may block a send until its receive is posted unless both sit in one group call;
  // ungrouped, a ring of them can deadlock. Not done yet: refuse rather than hang.
  TORCH_CHECK_NOT_IMPLEMENTED(send.device().is_cpu(), "tp_ext's ring ops (all_gather_linear, ",
                              "linear_reduce_scatter) run on CPU / gloo only for now; on CUDA ",
                              "use tp_ext.comm.set_overlap(None) (the default: no rings there).");
  RingShift s;
  const int tag = static_cast<int>(step);
  if (send.numel() > 0) {
    std::vector<at::Tensor> out{send};
    s.send = g.pg->send(out, static_cast<int>((g.rank + 1) % g.size), tag);
  }
  if (recv.numel() > 0) {
    std::vector<at::Tensor> in{recv};
    s.recv = g.pg->recv(in, static_cast<int>((g.rank + g.size - 1) % g.size), tag);
  }
  return s;
}

double ring_shift_finish(RingShift& s, const Group& g, const char* op) {
  auto t0 = Clock::now();
  for (auto* work : {&s.send, &s.recv}) {
    if (!*work) continue;
    try {
      const auto limit = op_timeout();  // unset: the process group's own timeout
      if (limit.count() > 0) {
        (*work)->wait(limit);
      } else {
        (*work)->wait();
      }
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "tp_ext.", op, " failed on rank ", g.rank, " of process group '", g.name,
                  "' (", g.size, " ranks) in a ring step: ", e.what());
    }
  }
  return seconds_since(t0);
}

at::Tensor finish(Pending& p) {
  if (p.g.size == 1) return p.out;  // nothing was communicated, nothing is recorded
  auto t0 = Clock::now();
  if (p.work) {
    wait(p.work, p.op, p.g);
    p.work.reset();
  }
  if (std::strcmp(p.collective, "reduce") == 0 && p.g.rank == p.root)
    finish_avg(p.out, p.reduce, p.g);
  record(p.op, p.collective, p.bytes, p.seconds + seconds_since(t0));
  return p.out;
}

}  // namespace tp_ext::comm
