"""tp_ext.ops.sampling_candidates / sampling_threshold / sampling_kept_mass / sampling_pick (the
local pieces of vocab-parallel sampling) against pure-PyTorch references of their formulas:
float32, bfloat16, float16 and float64 logits, temperatures 1 and 0.7, -inf logits, empty
vocabulary shards, padding, top-k / top-p / both, unresolved thresholds and their fallbacks, the
fallbacks of pick, a whole sampling step over three simulated ranks, bad arguments, inputs that
require grad, torch.compile; and the CUDA kernels against the same references (skipped without a
GPU)."""

import pytest
import torch

from tp_ext import ops

from .common import full

INF = float("inf")
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
TEMPERATURES = [1.0, 0.7]
# kept_mass: sums in another order than the reference's (fp32 rows of up to 300 terms here; the
# CUDA test's rows of up to 33k terms: LONG)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-14)}
LONG = {torch.float32: dict(rtol=2e-4, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-14)}


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def scaled(logits, temperature):
    """s = logits.to(acc) / temperature. On CUDA the divisor is a device tensor: CUDA divides by
    a Python (CPU) scalar as a multiplication by its reciprocal, which rounds differently; the
    ops divide."""
    s = logits.to(acc_of(logits.dtype))
    if s.is_cuda:
        return s / torch.tensor(temperature, dtype=s.dtype, device=s.device)
    return s / temperature


def kept_of(s, threshold):
    return (s >= threshold.unsqueeze(1)) & (s > -INF)


# ---- references ------------------------------------------------------------------------------


def ref_candidates(logits, temperature, count):
    s = scaled(logits, temperature)
    rows, v = s.shape
    values = torch.full((rows, count), -INF, dtype=s.dtype, device=s.device)
    indices = torch.full((rows, count), -1, dtype=torch.int64, device=s.device)
    k = min(count, v)
    sorted_s, order = torch.sort(s, dim=1, descending=True, stable=True)
    values[:, :k] = sorted_s[:, :k]
    indices[:, :k] = order[:, :k]
    return values, indices


def ref_threshold(candidates, top_k, top_p, total_mass, row_max, exact_count):
    rows, n = candidates.shape
    thresholds, resolved = [], []
    for b in range(rows):
        v = torch.sort(candidates[b], descending=True).values
        tau = v[top_k - 1] if 0 < top_k <= n else torch.tensor(-INF, dtype=v.dtype)
        if top_p >= 1.0:
            thresholds.append(tau)
            resolved.append(True)
            continue
        kept = (v >= tau) & (v > -INF)
        p = torch.where(kept, torch.exp(v - row_max[b]) / total_mass[b], 0.0)
        hits = ((torch.cumsum(p, 0) >= top_p) & kept).nonzero()
        if len(hits):
            j = hits[0, 0].item()
            thresholds.append(v[j])
            resolved.append(j < exact_count)
        # no hit: the kept candidates are every kept token when they are the whole vocabulary or
        # when the top-k cut inside the exact prefix bounds them; else more candidates are needed
        elif exact_count >= n or (0 < top_k <= n and top_k <= exact_count):
            thresholds.append(v[kept][-1] if kept.any() else torch.tensor(-INF, dtype=v.dtype))
            resolved.append(True)
        else:
            thresholds.append(torch.tensor(-INF, dtype=v.dtype))
            resolved.append(False)
    return torch.stack(thresholds).to(candidates.dtype), torch.tensor(resolved, dtype=torch.bool)


def weights(logits, temperature, threshold, row_max):
    """exp(s - row_max) of the kept tokens, 0 elsewhere (float64, for the references)."""
    s = scaled(logits, temperature)
    w = torch.exp(s.double() - row_max.double().unsqueeze(1))
    return torch.where(kept_of(s, threshold), w, 0.0), kept_of(s, threshold)


def ref_kept_mass(logits, temperature, threshold, row_max):
    return weights(logits, temperature, threshold, row_max)[0].sum(1)


def ref_pick(logits, temperature, threshold, row_max, target):
    w, kept = weights(logits, temperature, threshold, row_max)
    running = torch.cumsum(w, 1)
    out = []
    for b in range(w.shape[0]):
        idx = kept[b].nonzero().flatten()
        if len(idx) == 0:
            out.append(-1)
            continue
        over = idx[running[b, idx] > target[b].double()]
        out.append(over[0].item() if len(over) else idx[-1].item())
    return torch.tensor(out, dtype=torch.int64)


# ---- test data -------------------------------------------------------------------------------


def make_logits(rows, vocab, dtype, seed, device="cpu"):
    """Random logits with some -inf entries (row 1: one, row 2: all but two), scaled up so
    softmax is peaked enough for top-p to cut somewhere."""
    x = 3.0 * full((rows, vocab), seed, torch.float64)
    if rows > 1 and vocab > 3:
        x[1, 3] = -INF
    if rows > 2 and vocab > 2:
        x[2, 2:] = -INF
    return x.to(dtype).to(device)


def row_stats(logits, temperature):
    """(row_max, total_mass) of the whole vocabulary, in the accumulation dtype."""
    s = scaled(logits, temperature)
    m = s.amax(1)
    return m, torch.exp(s - m.unsqueeze(1)).sum(1)


def shards(logits, sizes):
    return list(torch.split(logits, sizes, dim=1))


# ---- sampling_candidates ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_candidates_match_reference(dtype, temperature):
    logits = make_logits(4, 37, dtype, seed=1)
    for count in (1, 5, 37, 50):  # 50 > V: padded
        values, indices = ops.sampling_candidates(logits, temperature, count)
        want_v, want_i = ref_candidates(logits, temperature, count)
        assert values.dtype == acc_of(dtype) and indices.dtype == torch.int64
        assert values.shape == indices.shape == (4, count)
        assert torch.equal(values, want_v), (count, values, want_v)  # bitwise: the same s
        assert torch.equal(indices, want_i), (count, indices, want_i)
        if count > 37:
            assert (values[:, 37:] == -INF).all() and (indices[:, 37:] == -1).all()


def test_candidates_ties_prefer_smaller_index():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, -0.0, 0.0, 0.0, -INF]])
    values, indices = ops.sampling_candidates(logits, 1.0, 6)
    assert indices.tolist() == [[1, 3, 2, 4, 5, 0]]
    assert values.tolist() == [[3.0, 3.0, 2.0, 2.0, 2.0, 1.0]]
    _, indices = ops.sampling_candidates(logits, 1.0, 9)  # -0.0 and 0.0 are equal: index order
    assert indices[0, 6:].tolist() == [6, 7, 8]
    for dtype in (torch.bfloat16, torch.float64):  # bf16: many ties; fp64: the sort path
        x = torch.tensor([[0.5, 0.25, 0.5, 0.25, 0.5]], dtype=dtype)
        assert ops.sampling_candidates(x, 1.0, 4)[1].tolist() == [[0, 2, 4, 1]]


def test_candidates_empty_shard_and_layouts():
    values, indices = ops.sampling_candidates(torch.empty(3, 0), 0.7, 4)
    assert values.shape == (3, 4) and (values == -INF).all() and (indices == -1).all()
    values, indices = ops.sampling_candidates(torch.empty(0, 5), 1.0, 2)
    assert values.shape == indices.shape == (0, 2)
    logits = make_logits(6, 4, torch.float32, seed=2).t()  # non-contiguous [4, 6]
    got = ops.sampling_candidates(logits, 0.7, 3)
    want = ref_candidates(logits.contiguous(), 0.7, 3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- sampling_threshold ----------------------------------------------------------------------


def gathered_candidates(logits, temperature, sizes, count):
    """Every simulated rank's candidates concatenated (what the caller all-gathers)."""
    parts = [ops.sampling_candidates(x, temperature, count)[0] for x in shards(logits, sizes)]
    return torch.cat(parts, dim=1)


def full_vocab_threshold(logits, temperature, top_k, top_p):
    """The true threshold, from the whole vocabulary (the candidates of one rank holding it)."""
    s = scaled(logits, temperature)
    m, total = row_stats(logits, temperature)
    v = s.shape[1]
    return ref_threshold(s, top_k, top_p, total, m, v)[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_threshold_matches_reference(dtype, temperature):
    logits = make_logits(5, 40, dtype, seed=3)
    sizes, count = [14, 13, 13], 8
    cands = gathered_candidates(logits, temperature, sizes, count)
    m, total = row_stats(logits, temperature)
    # every rank's top `count` are in the candidates: the first `count` sorted are exact
    for top_k, top_p in [(3, 1.0), (0, 0.6), (0, 0.9), (5, 0.7), (0, 1.0), (8, 0.95), (50, 0.5)]:
        got = ops.sampling_threshold(cands, top_k, top_p, total, m, count)
        want = ref_threshold(cands, top_k, top_p, total, m, count)
        assert got[0].dtype == acc_of(dtype) and got[1].dtype == torch.bool
        assert torch.equal(got[0], want[0]), (top_k, top_p, got, want)
        assert torch.equal(got[1], want[1]), (top_k, top_p, got, want)
        # a resolved threshold is the one the whole vocabulary gives
        truth = full_vocab_threshold(logits, temperature, top_k, top_p)
        assert torch.equal(got[0][got[1]], truth[got[1]]), (top_k, top_p, got, truth)


def test_threshold_top_k_only_and_ties():
    cands = torch.tensor([[1.0, 4.0, 3.0, 3.0, -INF], [2.0, -INF, -INF, -INF, -INF]])
    dummy = torch.zeros(2)
    thr, resolved = ops.sampling_threshold(cands, 3, 1.0, dummy, dummy, 0)
    assert thr.tolist() == [3.0, -INF] and resolved.all()  # row 2: its 3rd value is padding
    thr, _ = ops.sampling_threshold(cands, 0, 1.0, dummy, dummy, 0)
    assert thr.tolist() == [-INF, -INF]
    thr, _ = ops.sampling_threshold(cands, 6, 1.0, dummy, dummy, 0)  # top_k > N: no cut
    assert thr.tolist() == [-INF, -INF]


def test_threshold_unresolved_and_fallbacks():
    # sorted: 2, 1, 0, -1 (probabilities with row_max 2 and the mass of these four)
    cands = torch.tensor([[0.0, 2.0, -1.0, 1.0, -INF, -INF]])
    m = torch.tensor([2.0])
    total = torch.exp(torch.tensor([0.0, -1.0, -2.0, -3.0])).sum().reshape(1)
    # top_p 0.9 is reached at the third value (0.0): resolved only when 3 positions are exact
    for exact, ok in [(6, True), (3, True), (2, False), (0, False)]:
        thr, resolved = ops.sampling_threshold(cands, 0, 0.9, total, m, exact)
        assert thr.tolist() == [0.0] and resolved.tolist() == [ok], exact
    # a larger total mass (other ranks hold more): the candidates never reach top_p
    big = total * 2
    thr, resolved = ops.sampling_threshold(cands, 0, 0.9, big, m, 4)
    assert thr.tolist() == [-INF] and resolved.tolist() == [False]  # retry with more
    # the candidates are the whole vocabulary (rounding kept the sum under top_p): take them all
    thr, resolved = ops.sampling_threshold(cands, 0, 0.9, big, m, 6)
    assert thr.tolist() == [-1.0] and resolved.tolist() == [True]
    # top-k within the exact prefix bounds the kept set: its smallest value, resolved
    thr, resolved = ops.sampling_threshold(cands, 2, 0.9, big, m, 2)
    assert thr.tolist() == [1.0] and resolved.tolist() == [True]
    thr, resolved = ops.sampling_threshold(cands, 3, 0.9, big, m, 2)  # top-k past the exact part
    assert thr.tolist() == [-INF] and resolved.tolist() == [False]
    # nothing to keep (every candidate -inf), whole vocabulary: -inf, resolved
    pad = torch.full((1, 3), -INF)
    thr, resolved = ops.sampling_threshold(pad, 0, 0.5, total, m, 3)
    assert thr.tolist() == [-INF] and resolved.tolist() == [True]
    thr, resolved = ops.sampling_threshold(torch.empty(2, 0), 1, 0.5, m.expand(2), m.expand(2), 0)
    assert thr.tolist() == [-INF, -INF] and resolved.all()


def test_threshold_whole_vocabulary_rounding_fallback():
    # fp32 probabilities that sum to just under top_p = 1 - 2^-24 while exact_count >= N
    logits = make_logits(3, 20, torch.float32, seed=4)
    s = scaled(logits, 0.7)
    m, total = row_stats(logits, 0.7)
    top_p = 1.0 - 2.0**-24
    thr, resolved = ops.sampling_threshold(s, 0, top_p, total * 1.001, m, 20)
    want = ref_threshold(s, 0, top_p, total * 1.001, m, 20)
    assert torch.equal(thr, want[0]) and resolved.all()
    smallest = torch.where(s > -INF, s, INF).amin(1)
    assert torch.equal(thr, smallest)


# ---- sampling_kept_mass ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_kept_mass_matches_reference(dtype, temperature):
    logits = make_logits(4, 45, dtype, seed=5)
    m, _ = row_stats(logits, temperature)
    acc = acc_of(dtype)
    s = scaled(logits, temperature)
    for threshold in (
        torch.full((4,), -INF, dtype=acc),  # everything finite
        s[:, 7].clone(),  # a logit of each row: ties included
        torch.full((4,), INF, dtype=acc),  # nothing
    ):
        got = ops.sampling_kept_mass(logits, temperature, threshold, m)
        want = ref_kept_mass(logits, temperature, threshold, m)
        assert got.dtype == acc and got.shape == (4,)
        torch.testing.assert_close(got.double(), want, **TOL[acc])
    # an empty shard holds no mass; rows of -inf logits none either
    empty = torch.empty(2, 0, dtype=dtype)
    z = torch.zeros(2, dtype=acc)
    assert ops.sampling_kept_mass(empty, temperature, z - INF, z).tolist() == [0.0, 0.0]
    ninf = torch.full((2, 3), -INF, dtype=dtype)
    assert ops.sampling_kept_mass(ninf, temperature, z - INF, z).tolist() == [0.0, 0.0]


# ---- sampling_pick ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_pick_matches_reference(dtype, temperature):
    logits = make_logits(4, 300, dtype, seed=6)
    acc = acc_of(dtype)
    s = scaled(logits, temperature)
    m, _ = row_stats(logits, temperature)
    g = torch.Generator().manual_seed(7)
    for threshold in (torch.full((4,), -INF, dtype=acc), s[:, 11].clone()):
        mass = ops.sampling_kept_mass(logits, temperature, threshold, m)
        for _ in range(5):
            target = (torch.rand(4, generator=g, dtype=torch.float64) * mass.double()).to(acc)
            got = ops.sampling_pick(logits, temperature, threshold, m, target)
            want = ref_pick(logits, temperature, threshold, m, target)
            assert got.dtype == torch.int64
            assert torch.equal(got, want), (got, want)
            kept = kept_of(s, threshold)
            assert kept.gather(1, got.unsqueeze(1)).all()


def test_pick_fallbacks():
    logits = torch.tensor([[0.0, -INF, 1.0, 2.0, -1.0], [-INF, -INF, -INF, -INF, -INF]])
    m = torch.tensor([2.0, 2.0])
    thr = torch.tensor([0.0, -INF])  # row 0 keeps 0, 2, 3
    w = torch.exp(torch.tensor([0.0, 1.0, 2.0]) - 2.0)
    cases = [  # (target of row 0, want)
        (0.0, 0),
        (w[0].item() * 0.99, 0),
        (w[0].item() + w[1].item() * 0.5, 2),
        (w.sum().item() * 0.999, 3),
        (w.sum().item() * 10, 3),  # beyond the total: the last kept token
        (-1.0, 0),
    ]
    for target, want in cases:
        got = ops.sampling_pick(logits, 1.0, thr, m, torch.tensor([target, 0.5]))
        assert got.tolist() == [want, -1], (target, got)  # row 1 keeps nothing: -1
    nothing = torch.tensor([INF, INF])
    assert ops.sampling_pick(logits, 1.0, nothing, m, torch.zeros(2)).tolist() == [-1, -1]
    empty = torch.empty(2, 0)
    assert ops.sampling_pick(empty, 1.0, thr, m, torch.zeros(2)).tolist() == [-1, -1]


# ---- a whole sampling step over simulated ranks --------------------------------------------


def sample_step(logits, temperature, top_k, top_p, u, sizes):
    """The caller's algorithm on shards of the vocabulary (collectives as torch ops): candidates,
    threshold (retrying with more candidates until resolved), kept mass, pick. Returns global
    token ids."""
    parts = shards(logits, sizes)
    rows = logits.shape[0]
    acc = acc_of(logits.dtype)
    m = torch.stack([scaled(x, temperature).amax(1) for x in parts if x.shape[1]]).amax(0)
    total = sum(
        ops.sampling_kept_mass(x, temperature, torch.full((rows,), -INF, dtype=acc), m)
        for x in parts
    )
    count = max(top_k, 1)
    while True:
        cands = torch.cat([ops.sampling_candidates(x, temperature, count)[0] for x in parts], 1)
        thr, resolved = ops.sampling_threshold(cands, top_k, top_p, total, m, count)
        if resolved.all():
            break
        count *= 2
    masses = torch.stack([ops.sampling_kept_mass(x, temperature, thr, m) for x in parts], 1)
    target = (u * masses.sum(1).double()).to(acc)
    out = torch.full((rows,), -1, dtype=torch.int64)
    start, before = 0, torch.zeros(rows, dtype=acc)
    for r, x in enumerate(parts):
        here = (before + masses[:, r] > target) & (out < 0)
        local = ops.sampling_pick(x, temperature, thr, m, target - before)
        out = torch.where(here & (local >= 0), local + start, out)
        before, start = before + masses[:, r], start + x.shape[1]
    return out, thr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampling_step_matches_the_whole_vocabulary(dtype):
    logits = make_logits(4, 50, dtype, seed=8)
    u = torch.tensor([0.1, 0.5, 0.77, 0.95], dtype=torch.float64)
    for top_k, top_p in [(0, 1.0), (5, 1.0), (0, 0.8), (10, 0.9)]:
        got, thr = sample_step(logits, 0.7, top_k, top_p, u, [17, 0, 17, 16])
        truth = full_vocab_threshold(logits, 0.7, top_k, top_p)
        assert torch.equal(thr, truth), (top_k, top_p)
        m, _ = row_stats(logits, 0.7)
        mass = ops.sampling_kept_mass(logits, 0.7, thr, m)
        want = ref_pick(logits, 0.7, thr, m, (u * mass.double()).to(acc_of(dtype)))
        assert torch.equal(got, want), (top_k, top_p, got, want)


# ---- errors, autograd, compile ---------------------------------------------------------------


def test_bad_arguments():
    x = torch.randn(2, 5)
    z = torch.zeros(2)
    cands = torch.randn(2, 4)
    cases = [
        (lambda: ops.sampling_candidates(x, 1.0, 0), r"count=0 must be >= 1"),
        (lambda: ops.sampling_candidates(x, 0.0, 2), r"temperature=0 must be finite and > 0"),
        (lambda: ops.sampling_candidates(x, -1.0, 2), r"temperature=-1 must be finite and > 0"),
        (lambda: ops.sampling_candidates(x, INF, 2), r"temperature=inf must be finite"),
        (lambda: ops.sampling_kept_mass(x, 1e-60, z, z), r"not a finite positive float32"),
        (lambda: ops.sampling_candidates(x[0], 1.0, 2), r"logits must be 2-d \[batch, V_local\]"),
        (lambda: ops.sampling_candidates(x.long(), 1.0, 2), r"logits must be floating point"),
        (lambda: ops.sampling_threshold(cands, -1, 0.9, z, z, 0), r"top_k=-1 is negative"),
        (lambda: ops.sampling_threshold(cands, 0, 0.0, z, z, 0), r"top_p=0 is outside \(0, 1\]"),
        (lambda: ops.sampling_threshold(cands, 0, 1.5, z, z, 0), r"top_p=1.5 is outside"),
        (lambda: ops.sampling_threshold(cands, 0, float("nan"), z, z, 0), r"top_p=nan"),
        (lambda: ops.sampling_threshold(cands, 0, 0.9, z, z, -1), r"exact_count=-1 is negative"),
        (
            lambda: ops.sampling_threshold(cands, 0, 1.0, torch.zeros(3), z, 0),
            r"total_mass has shape \[3\]; it must be 1-d \[batch\] = \[2\]",
        ),
        (
            lambda: ops.sampling_threshold(cands, 0, 0.9, z, z.double(), 0),
            r"row_max has dtype Double; it must be Float",
        ),
        (
            lambda: ops.sampling_threshold(cands.half(), 0, 0.9, z, z, 0),
            r"candidates must be float32 or float64",
        ),
        (
            lambda: ops.sampling_kept_mass(x, 1.0, torch.zeros(2, 1), z),
            r"threshold has shape \[2, 1\]; it must be 1-d \[batch\] = \[2\]",
        ),
        (
            lambda: ops.sampling_kept_mass(x.double(), 1.0, z, z),
            r"threshold has dtype Float; it must be Double",
        ),
        (
            lambda: ops.sampling_pick(x, 1.0, z, z, torch.zeros(2, dtype=torch.float64)),
            r"target has dtype Double; it must be Float",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match="tp_ext.sampling_.*" + message):
            call()


def test_inputs_requiring_grad():
    """No derivatives: the ops run on inputs that require grad, and asking for a gradient is an
    error naming the op."""
    x = torch.randn(2, 6, requires_grad=True)
    values, indices = ops.sampling_candidates(x, 0.7, 3)
    assert torch.equal(values, ref_candidates(x.detach(), 0.7, 3)[0])
    m = torch.zeros(2, requires_grad=True)
    mass = ops.sampling_kept_mass(x, 0.7, torch.full((2,), -INF), m)
    picked = ops.sampling_pick(x, 0.7, torch.full((2,), -INF), m, torch.zeros(2))
    assert not picked.requires_grad
    with pytest.raises(RuntimeError, match="derivative for tp_ext::sampling_kept_mass is not"):
        mass.sum().backward()
    with torch.no_grad():
        assert not ops.sampling_candidates(x, 0.7, 3)[0].requires_grad


def test_compile_fullgraph():
    def step(logits, u):
        values, _ = ops.sampling_candidates(logits, 0.7, 4)
        m = values[:, 0]
        total = ops.sampling_kept_mass(logits, 0.7, torch.full_like(m, -INF), m)
        thr, resolved = ops.sampling_threshold(values, 2, 0.9, total, m, 4)
        mass = ops.sampling_kept_mass(logits, 0.7, thr, m)
        return ops.sampling_pick(logits, 0.7, thr, m, u * mass), resolved

    logits, u = make_logits(3, 10, torch.float32, seed=9), torch.tensor([0.2, 0.5, 0.9])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(logits, u), step(logits, u)):
        assert torch.equal(a, b)


# ---- CUDA ------------------------------------------------------------------------------------


def near_top_p(candidates, top_k, top_p, total_mass, row_max, tol=1e-5):
    """[B] bool: rows where a kept candidate's cumulative probability is within tol of top_p."""
    if top_p >= 1.0:
        return torch.zeros(candidates.shape[0], dtype=torch.bool)
    v = torch.sort(candidates.double(), dim=1, descending=True).values
    n = v.shape[1]
    tau = v[:, top_k - 1 : top_k] if 0 < top_k <= n else torch.full_like(v[:, :1], -INF)
    kept = (v >= tau) & (v > -INF)
    p = torch.where(kept, torch.exp(v - row_max.double().unsqueeze(1)), 0.0)
    c = torch.cumsum(p, 1) / total_mass.double().unsqueeze(1)
    return ((c - top_p).abs() < tol).any(1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_cuda_matches_reference(dtype, temperature):
    acc = acc_of(dtype)
    for rows, vocab in [(4, 37), (3, 5000), (2, 1), (1, 33000)]:
        logits = make_logits(rows, vocab, dtype, seed=10).cuda()
        # candidates: bitwise the reference's (a true division on the device too)
        for count in (1, 7, vocab + 3):
            got = ops.sampling_candidates(logits, temperature, count)
            want = ref_candidates(logits, temperature, count)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), count
        s = scaled(logits, temperature)
        m = s.amax(1)
        everything = torch.full((rows,), -INF, dtype=acc, device="cuda")
        total = ops.sampling_kept_mass(logits, temperature, everything, m)
        torch.testing.assert_close(
            total.cpu().double(),
            ref_kept_mass(logits, temperature, everything, m).cpu(),
            **LONG[acc],
        )
        # threshold: the same composition as on the CPU
        cands = ops.sampling_candidates(logits, temperature, 16)[0]
        for top_k, top_p in [(3, 1.0), (0, 0.8), (5, 0.7)]:
            got = ops.sampling_threshold(cands, top_k, top_p, total, m, 16)
            want = ops.sampling_threshold(cands.cpu(), top_k, top_p, total.cpu(), m.cpu(), 16)
            # equal, except where a cumulative probability is within rounding of top_p (the
            # device's exp and cumsum round differently)
            same = ~near_top_p(cands.cpu(), top_k, top_p, total.cpu(), m.cpu())
            assert torch.equal(got[0].cpu()[same], want[0][same]), (top_k, top_p)
            assert torch.equal(got[1].cpu()[same], want[1][same]), (top_k, top_p)
            thr = got[0]
            mass = ops.sampling_kept_mass(logits, temperature, thr, m)
            torch.testing.assert_close(
                mass.cpu().double(), ref_kept_mass(logits, temperature, thr, m).cpu(), **LONG[acc]
            )
            # pick: a kept token whose interval holds target up to rounding
            for u in (0.0, 0.3, 0.999, 2.0):
                target = (mass.double() * u).to(acc)
                got_pick = ops.sampling_pick(logits, temperature, thr, m, target).cpu()
                want_pick = ref_pick(logits, temperature, thr, m, target)
                w, kept = weights(logits, temperature, thr, m)
                w, kept, running = w.cpu(), kept.cpu(), torch.cumsum(w.cpu(), 1)
                for b in range(rows):
                    i = got_pick[b].item()
                    if want_pick[b] < 0:
                        assert i == -1
                        continue
                    assert i >= 0 and kept[b, i], (b, i)
                    last = kept[b].nonzero().max().item()
                    if u > 1:  # beyond the total: the last kept token
                        assert i == last, (b, i, last)
                    elif i != last:
                        slack = 1e-5 * running[b, -1].item() + 1e-30
                        before = running[b, i].item() - w[b, i].item()
                        t = target[b].item()
                        assert before - slack <= t < running[b, i].item() + slack, (b, i, t)
    # fallbacks and empty shards on the device
    z = torch.zeros(2, dtype=acc, device="cuda")
    empty = torch.empty(2, 0, dtype=dtype, device="cuda")
    assert ops.sampling_pick(empty, temperature, z - INF, z, z).tolist() == [-1, -1]
    assert ops.sampling_kept_mass(empty, temperature, z - INF, z).tolist() == [0.0, 0.0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_opcheck():
    logits = make_logits(3, 9, torch.float32, seed=11).cuda()
    values, _ = ops.sampling_candidates(logits, 0.7, 4)
    m = values[:, 0].contiguous()
    thr = values[:, 2].contiguous()
    for name, args in [
        ("sampling_candidates", (logits, 0.7, 4)),
        ("sampling_threshold", (values, 2, 0.9, m.exp(), m, 4)),
        ("sampling_kept_mass", (logits, 0.7, thr, m)),
        ("sampling_pick", (logits, 0.7, thr, m, torch.full_like(m, 0.5))),
    ]:
        result = torch.library.opcheck(getattr(torch.ops.tp_ext, name).default, args)
        assert all(v == "SUCCESS" for v in result.values()), (name, result)
