// Every tp_ext op schema, in one place. Kernels live next to their family:
//   comm/collective_ops.cpp   plain collectives (CPU and CUDA kernels)
//   comm/megatron_pairs.cpp   differentiable Megatron pairs (CPU/CUDA kernels + C++ autograd)
//   loss/vocab_cross_entropy.cpp           local pieces of the vocab-parallel cross-entropy (CPU)
//   loss/vocab_parallel_cross_entropy.cpp  the communicating loss op (C++ autograd)
// Fake (meta) kernels for all of them are in tp_ext/_fake.py.
//
// Communicating ops name their process group by `group_name` (c10d's registry) and pass
// `group_size`, as torch's own _c10d_functional ops do: graphs stay serialisable and the fake
// kernels know output shapes without a live group. `sizes` lists every rank's size along `dim`
// when the split is uneven (tp_ext.shard_sizes gives the standard one); None means an even split.
// Ops whose result (or gradient) is this rank's piece also take `group_rank`, checked against the
// group: a traced graph then says which rank it is for, so compile caches never hand one rank's
// graph to another, and fake kernels need no live group.
#include <torch/library.h>

TORCH_LIBRARY(tp_ext, m) {
  // ---- plain collectives: no autograd (use the pairs below for training) ----
  // reduce in {sum, avg, max, min, product}
  m.def("all_reduce(Tensor x, str reduce, str group_name, int group_size) -> Tensor");
  m.def("all_gather(Tensor x, int dim, int[]? sizes, str group_name, int group_size) -> Tensor");
  m.def(
      "reduce_scatter(Tensor x, int dim, int[]? sizes, str reduce, str group_name, "
      "int group_size, int group_rank) -> Tensor");
  m.def("broadcast(Tensor x, int src, str group_name, int group_size) -> Tensor");
  m.def(
      "all_to_all(Tensor x, int scatter_dim, int gather_dim, int[]? sizes, str group_name, "
      "int group_size, int group_rank) -> Tensor");

  // ---- Megatron pairs (forward / backward), autograd in C++ ----
  m.def("copy_to_tp(Tensor x, str group_name, int group_size) -> Tensor");      // id / all-reduce
  m.def("reduce_from_tp(Tensor x, str group_name, int group_size) -> Tensor");  // all-reduce / id
  m.def(  // split / all-gather
      "scatter_to_tp(Tensor x, int dim, int[]? sizes, str group_name, int group_size, "
      "int group_rank) -> Tensor");
  m.def(  // all-gather / split
      "gather_from_tp(Tensor x, int dim, int[]? sizes, str group_name, int group_size, "
      "int group_rank) -> Tensor");
  m.def(  // all-gather / reduce-scatter
      "gather_from_sp(Tensor x, int dim, int[]? sizes, str group_name, int group_size, "
      "int group_rank) -> Tensor");
  m.def(  // reduce-scatter / all-gather
      "reduce_scatter_to_sp(Tensor x, int dim, int[]? sizes, str group_name, int group_size, "
      "int group_rank) -> Tensor");

  // ---- loss ----
  // Cross-entropy of logits split over the group along the vocabulary (last) dim, by the
  // shard_sizes policy. Per-token loss (fp32; fp64 for fp64 logits), shape target.shape, 0 where
  // target == ignore_index; label smoothing over the full vocabulary. Two token-sized all-reduces
  // forward (max, then sum), none backward; every rank's shard size travels in the first one.
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, int ignore_index, "
      "float label_smoothing, str group_name, int group_size, int group_rank) -> Tensor");
  // Its local (non-communicating) pieces. `max_sizes` is vocab_ce_local_max's output after a max
  // all-reduce: N per-token global maxima, then every rank's vocab size. Sizes are a tensor, not
  // ints, because they are only known after communicating (a traced graph cannot bake them in).
  m.def(  // [N + group_size]: per-token max of this shard, then this shard's size at N + group_rank
      "vocab_ce_local_max(Tensor logits, int group_size, int group_rank) -> Tensor");
  m.def(  // [N, 3]: sum exp(l - max), target logit if in this shard else 0, sum of logits
      "vocab_ce_local_stats(Tensor logits, Tensor target, Tensor max_sizes, int ignore_index, "
      "int group_rank) -> Tensor");
  m.def(  // gradient of the logits shard given the loss gradient and the per-token logsumexp
      "vocab_ce_local_grad(Tensor grad_loss, Tensor logits, Tensor target, Tensor max_sizes, "
      "Tensor lse, int ignore_index, float label_smoothing, int group_rank) -> Tensor");
}
