// Every tp_ext op schema, and only schemas: the one TORCH_LIBRARY block of tp_ext. Kernels register
// themselves with TORCH_LIBRARY_IMPL next to their code (csrc/README.md: where each op's files are
// and the registration rule); Python wrappers and fake kernels are in the tp_ext package.
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
  // ---- plain collectives (comm/collective_ops.cpp): no autograd (the pairs below train) ----
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

  // Uneven all-to-all along dim 0 (expert parallelism's token dispatch and combine): rows
  // [sum(send_sizes[:r]), +send_sizes[r]) go to rank r; what rank r sends arrives as
  // recv_sizes[r] rows, in rank order. Every pair of ranks must agree (my send_sizes[r] is rank
  // r's recv_sizes[me]). Differentiable (comm/expert_dispatch.cpp): the backward is the same op
  // with the sizes swapped. The accounting records the bytes sent to other ranks.
  m.def(
      "all_to_all_single(Tensor x, SymInt[] send_sizes, SymInt[] recv_sizes, str group_name, "
      "int group_size) -> Tensor");

  // ---- Megatron pairs (comm/megatron_pairs.cpp): forward / backward, autograd in C++ ----
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

  // ---- loss (ops/vocab_parallel_cross_entropy.cpp, ops/vocab_cross_entropy.{cpp,cu}) ----
  // Cross-entropy of logits split over the group along the vocabulary (last) dim, by the
  // shard_sizes policy. Per-token loss (fp32; fp64 for fp64 logits), shape target.shape, 0 where
  // target == ignore_index; label smoothing over the full vocabulary. Two token-sized all-reduces
  // forward (max, then sum), none backward; every rank's shard size travels in the first one.
  // The logits are read once forward (vocab_ce_local_stats) and once backward.
  // Autograd in C++ (backward: vocab_ce_local_grad).
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, int ignore_index, "
      "float label_smoothing, str group_name, int group_size, int group_rank) -> Tensor");
  // Its local (non-communicating) pieces. `max_sizes` is vocab_ce_local_stats's first output
  // after a max all-reduce: N per-token global maxima, then every rank's vocab size. Sizes are a
  // tensor, not ints, because they are only known after communicating (a traced graph cannot bake
  // them in).
  m.def(  // one read of the logits: ([N + group_size]: per-token max M of this shard, then this
          // shard's size at N + group_rank; [N, 2]: sum exp(l - M), sum of logits)
      "vocab_ce_local_stats(Tensor logits, int group_size, int group_rank) -> (Tensor, Tensor)");
  m.def(  // [N]: the target's logit if this shard holds it, else 0 (checks the target ids)
      "vocab_ce_target_logit(Tensor logits, Tensor target, Tensor max_sizes, int ignore_index, "
      "int group_rank) -> Tensor");
  m.def(  // gradient of the logits shard given the loss gradient and the per-token logsumexp
      "vocab_ce_local_grad(Tensor grad_loss, Tensor logits, Tensor target, Tensor max_sizes, "
      "Tensor lse, int ignore_index, float label_smoothing, int group_rank) -> Tensor");

  // ---- sampling (ops/sampling.{h,cpp}, ops/sampling_cuda.cu) ----
  // Temperature / top-k / top-p sampling from logits split by vocabulary over the group, without
  // gathering them: the local pieces (the caller communicates). Every op scales the logits shard
  // [B, V_local] as s = logits.to(acc) / temperature (acc: fp64 for fp64 logits, else fp32; a true
  // division, so s is bitwise the same everywhere); a token is kept when s >= threshold and
  // s > -inf. No derivatives (inference only).
  m.def(  // (values [B, count] acc: the count largest s per row, descending, ties in index order;
          // indices [B, count] int64, local columns), padded with (-inf, -1) past V_local
      "sampling_candidates(Tensor logits, float temperature, int count) -> (Tensor, Tensor)");
  m.def(  // (threshold [B] acc, resolved [B] bool) from every rank's candidates [B, N]: top-k's
          // k-th largest, then top-p's first sorted value whose cumulative probability
          // exp(v - row_max) / total_mass reaches top_p; resolved: final (within the exact_count
          // leading candidates that are the true global order), else retry with more candidates
      "sampling_threshold(Tensor candidates, int top_k, float top_p, Tensor total_mass, "
      "Tensor row_max, int exact_count) -> (Tensor, Tensor)");
  m.def(  // [B] acc: sum of exp(s - row_max) over this shard's kept tokens
      "sampling_kept_mass(Tensor logits, float temperature, Tensor threshold, Tensor row_max) -> "
      "Tensor");
  m.def(  // [B] int64: the first kept token (in order) whose running sum of exp(s - row_max)
          // exceeds target; the last kept token if none does; -1 if none is kept
      "sampling_pick(Tensor logits, float temperature, Tensor threshold, Tensor row_max, "
      "Tensor target) -> Tensor");

  // ---- attention over key blocks (ring attention: ops/attention_merge.*) ----
  // attention_merge: two partial attention results over disjoint key blocks (out [..., S, D] and
  // its log-sum-exp [..., S], as flash attention returns them) merged into the attention over
  // both (online softmax); backward: attention_merge_backward.
  m.def(
      "attention_merge(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, "
      "Tensor)");
  m.def(  // (grad_out_a, grad_lse_a, grad_out_b, grad_lse_b); out, lse: the merged result
      "attention_merge_backward(Tensor grad_out, Tensor grad_lse, Tensor out_a, Tensor lse_a, "
      "Tensor out_b, Tensor lse_b, Tensor out, Tensor lse) -> (Tensor, Tensor, Tensor, Tensor)");

  // ---- attention over a paged KV cache (the serving engine: ops/paged_attention.cpp) ----
  // paged_attention: q [R, Hq, S, D] over the keys and values in the pools' slots [R, L] (key
  // column c of row r in slot slots[r, c]), each query seeing the real keys (key_mask) up to its
  // own column past + j; no derivative.
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor key_mask, "
      "int past, float scale) -> Tensor");

  // ---- the local GEMM (ops/linear.cpp) ----
  // linear: y = x W^T + b through tp_ext's GEMMs (common/gemm.h: oneDNN for float32 on CPU);
  // autograd in C++, its backward the op itself on transposed operands.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");

  // ---- linear layers fused with their TP communication (comm/overlapped_linear.cpp) ----
  // column_linear: y = x W^T + b, x replicated (saved for backward as it is: no copy); with
  // overlap, backward starts the input-gradient all-reduce before the weight-gradient GEMM and
  // waits after it (without: a blocking all-reduce, e.g. the shared-memory channel's).
  // all_gather_linear: y = gather(x) W^T + b with x this rank's sequence shard along dim, as a ring
  // (each shard's GEMM while the next one travels); returns (y, gathered x). linear_reduce_scatter:
  // reduce_scatter(x W^T) along dim, as a ring of accumulators. Autograd in C++ through the
  // *_backward ops (no double backward).
  m.def(
      "column_linear(Tensor x, Tensor weight, Tensor? bias, str group_name, int group_size, "
      "bool overlap=True) -> Tensor");
  m.def(  // (grad_x all-reduced, grad_weight, grad_bias)
      "column_linear_backward(Tensor grad, Tensor x, Tensor weight, str group_name, "
      "int group_size, bool overlap=True) -> (Tensor, Tensor, Tensor)");
  m.def(  // column_linear for several layers reading x (q, k, v): one gradient all-reduce
      "column_linears(Tensor x, Tensor[] weights, Tensor[] biases, str group_name, "
      "int group_size, bool overlap=True) -> Tensor[]");
  m.def(  // (grad_x: sum over the layers, all-reduced; grad_weights; grad_biases if bias)
      "column_linears_backward(Tensor[] grads, Tensor x, Tensor[] weights, bool bias, "
      "str group_name, int group_size, bool overlap=True) -> (Tensor, Tensor[], Tensor[])");
  m.def(
      "all_gather_linear(Tensor x, Tensor weight, Tensor? bias, int dim, int[]? sizes, "
      "str group_name, int group_size, int group_rank) -> (Tensor, Tensor)");
  m.def(  // (grad_x reduce-scattered to this rank's shard, grad_weight, grad_bias)
      "all_gather_linear_backward(Tensor grad, Tensor x_full, Tensor weight, int dim, "
      "int[]? sizes, str group_name, int group_size, int group_rank) -> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_reduce_scatter(Tensor x, Tensor weight, int dim, int[]? sizes, str group_name, "
      "int group_size, int group_rank) -> Tensor");
  m.def(  // (grad_x, grad_weight): the gradient's shards gathered round the ring
      "linear_reduce_scatter_backward(Tensor grad, Tensor x, Tensor weight, int dim, "
      "int[]? sizes, str group_name, int group_size, int group_rank) -> (Tensor, Tensor)");

  // ---- 2D tensor parallelism (SUMMA) (ops/summa_linear.cpp, comm/collectives.*) ----
  // Y = X W^T on a P x Q grid: rank (grid_row i, grid_col j) holds x = X[its row's tokens, K-part
  // j of x_in_sizes] ([..., k_j]) and weight = W[N-part j, K-part i of w_in_sizes] and gets
  // Y[tokens, N-part j]. Row group: the Q ranks of grid row i (this rank is grid_col in it);
  // column group: the P ranks of grid column j (grid_row in it). K panels (the union of both
  // splits) broadcast over the row (x) and column (weight) groups, overlapped with the GEMMs. No
  // bias. Autograd in C++ through summa_linear_backward.
  m.def(
      "summa_linear(Tensor x, Tensor weight, int[] x_in_sizes, int[] w_in_sizes, "
      "str row_group_name, int grid_cols, int grid_col, str col_group_name, int grid_rows, "
      "int grid_row) -> Tensor");
  m.def(  // (grad_x, grad_weight): panel broadcasts, then partials reduced to their owners
      "summa_linear_backward(Tensor grad, Tensor x, Tensor weight, int[] x_in_sizes, "
      "int[] w_in_sizes, str row_group_name, int grid_cols, int grid_col, str col_group_name, "
      "int grid_rows, int grid_row) -> (Tensor, Tensor)");

  // ---- fused norms (ops/rms_norm.{cpp,cu}): fp32 math, output dtype promote(x, weight) ----
  // rms_norm = weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype) (Hugging
  // Face's RMSNorm); add_rms_norm = (rms_norm(h), h) with h = x + residual in x's dtype.
  // Autograd in C++ through rms_norm_backward (grad_x, grad_weight; rstd recomputed).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");

  // ---- gradient compression (ops/grad_compression.{h,cpp,cu}) ----
  // Per chunk of chunk_size elements, one fp32 scale; v = grad + residual (error feedback) and
  // residual <- v - what is sent, in place. int8: codes round(v / scale), scale = max|v| / 127.
  // 1-bit: sign bits (8 a byte, element i at bit i % 8), scale = mean|v|, chunk_size % 8 == 0.
  // No derivative (they run on gradients, in DDP communication hooks).
  m.def("quantize_int8_ef(Tensor grad, Tensor(a!) residual, int chunk_size) -> (Tensor, Tensor)");
  m.def("dequantize_int8(Tensor codes, Tensor scales, int chunk_size) -> Tensor");
  m.def("quantize_1bit_ef(Tensor grad, Tensor(a!) residual, int chunk_size) -> (Tensor, Tensor)");
  m.def("dequantize_1bit(Tensor bits, Tensor scales, int chunk_size, int numel) -> Tensor");

  // ---- mixture-of-experts token permutation (ops/moe_permute.{h,cpp,cu}) ----
  // moe_route: a stable counting sort of the routing. expert_ids [T, k] (-1: a dropped choice) ->
  // (row_map [T, k] int64: the row of (token t, choice j) when rows are ordered by expert, then
  // t, then j; -1 where dropped. counts [E] int64: rows per expert). No derivative.
  m.def("moe_route(Tensor expert_ids, int num_experts) -> (Tensor, Tensor)");
  // moe_permute: [num_rows, H], out[row_map[t, j]] = weights[t, j] * x[t] (x[t] without weights);
  // rows no entry names are zero. moe_unpermute: [T, H], out[t] = sum_j weights[t, j] *
  // y[row_map[t, j]] (1 without weights), fp32 math rounded once. Each is the other's backward;
  // moe_weight_grad is the weights' gradient of both: [T, k] = dot(tokens[t], rows[row_map[t,
  // j]]), 0 where dropped (fp32; fp64 for fp64). Autograd in C++.
  m.def("moe_permute(Tensor x, Tensor row_map, Tensor? weights, int num_rows) -> Tensor");
  m.def("moe_unpermute(Tensor y, Tensor row_map, Tensor? weights) -> Tensor");
  m.def("moe_weight_grad(Tensor tokens, Tensor rows, Tensor row_map) -> Tensor");

  // ---- fused activation (ops/swiglu.{cpp,cu}) ----
  // swiglu = silu(gate) * up with gate, up the halves of gate_up's last dim; fp32 math (fp64 for
  // fp64) rounded once. Autograd in C++ through swiglu_backward (-> grad_gate_up).
  m.def("swiglu(Tensor gate_up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate_up) -> Tensor");

  // ---- rotary embedding (ops/rotary_embedding.{cpp,cu}) ----
  // HF rotate_half RoPE on q [B, Hq, S, D] and k [B, Hk, S, D] (Hq != Hk allowed: GQA) with
  // cos/sin [B, S, D] broadcast over heads: x * cos + rotate_half(x) * sin. Outputs keep the
  // inputs' strides. Differentiable in q, k, cos and sin: the backward is this op again with
  // sin' = -(sin_hi, sin_lo) (no separate backward op).
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}
