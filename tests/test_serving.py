"""The serving engine (tp_ext/serving/): requests of prompt lengths 1 to 40 that join and leave
the running batch, read in chunks, preempted when the paged KV cache runs out and sharing
cached prompt prefixes, each give transformers' greedy tokens of that prompt alone, at TP 1 to
4, for Hugging Face Llama, Qwen2 and Mixtral (experts over the TP ranks) converted by
``parallelize`` and for tp_ext's native Qwen2; a seeded sampled request gives the same tokens at
any TP and whatever runs beside it; a cancelled request frees its blocks at once; the block pool
and bad requests."""

import copy

import pytest
import torch

import tp_ext
from tp_ext.serving import Engine, FinishReason, SamplingParams
from tp_ext.serving.kv_cache import BlockPool

from .dist_utils import run_distributed
from .test_generate import _native, _reference
from .test_parallelize_models import VOCAB

NEW = 8
SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15]  # a prefix two prompts share (two full blocks of 4)


def _prompts(seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (3, 40, 1, 17)]
    return [SHARED + [20, 21], *prompts, SHARED + [30]]  # the second joins after the first ran


def _greedy_reference(reference, prompt: list) -> list:
    ids = torch.tensor([prompt])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _drain(engine: Engine) -> dict:
    """Every request's tokens, stepping until none is left."""
    tokens: dict = {}
    while engine.has_work:
        for out in engine.step():
            if out.token is not None:
                tokens.setdefault(out.request_id, []).append(out.token)
    return tokens


def _engine(model, state, **options):
    # 3 requests at once, 16 tokens a step (prompts read in chunks), 14 blocks of 4 positions:
    # fewer than 3 requests of 48 need, so some are preempted and recomputed
    sizes = dict(num_blocks=14, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    return Engine(model, parallel=state, **{**sizes, **options})


WINDOWED = {  # sliding windows shorter than the prompts, and Gemma 2's soft-capping
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=6, head_dim=8, attn_logit_softcapping=5.0)),
}  # fmt: skip


def _model_reference(arch: str):
    if arch not in WINDOWED:
        return _reference("qwen2" if arch == "native" else arch)
    import transformers

    from .test_generate import CONFIG

    config_class, model_class, extra = WINDOWED[arch]
    config = getattr(transformers, config_class)(**{**CONFIG, **extra})
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).double().eval()


def _greedy_case(tp, ep, archs, directory=None, pp=1):
    state = tp_ext.init_parallel(tp=tp, pp=pp, ep=ep)
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=NEW, temperature=0)  # to an EOS, as transformers
    report = {}
    for arch in archs:
        reference = _model_reference(arch)
        if arch == "native":
            model = _native(reference, state, directory)
        else:
            model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)
        engine = _engine(model, state)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy)
        got = _drain(engine)
        for i, prompt in enumerate(prompts):
            assert got[str(i)] == _greedy_reference(reference, prompt), (arch, i)
        assert engine.pool.used == 0 and not engine.requests  # every block back
        report[arch] = (engine.scheduler.preemptions, engine.pool.prefix_hits)
    return report


@pytest.mark.parametrize(
    "tp,ep,archs",
    [
        (1, 1, ["llama", "native"]),
        (2, 1, ["llama", "qwen2", "native"]),
        (3, 1, ["qwen2"]),  # uneven: 2 KV heads over 3 ranks, 101 vocabulary rows
        (2, 1, ["mistral", "gemma2"]),  # sliding windows, soft-capping
        (2, 2, ["mixtral"]),  # experts over the TP ranks
        pytest.param(4, 1, ["llama", "native"], marks=pytest.mark.full_matrix),
        pytest.param(3, 1, ["llama", "native"], marks=pytest.mark.full_matrix),
    ],
)
def test_each_request_decodes_as_transformers_alone(tp, ep, archs, tmp_path):
    reports = run_distributed(_greedy_case, tp, tp, ep, archs, str(tmp_path))
    for arch, (preemptions, prefix_hits) in reports[0].items():
        assert preemptions > 0, f"{arch}: the test meant to preempt"
        assert prefix_hits > 0, f"{arch}: the shared prefix was not reused"


@pytest.mark.parametrize(
    "tp,pp,archs",
    [
        (1, 2, ["llama", "native"]),  # the stages on two ranks, tokens sent back from the last
        pytest.param(2, 2, ["qwen2", "native"], marks=pytest.mark.full_matrix),
    ],
)
def test_pipeline_stages_decode_as_transformers(tp, pp, archs, tmp_path):
    reports = run_distributed(_greedy_case, tp * pp, tp, 1, archs, str(tmp_path), pp)
    assert all(preempted > 0 for preempted, _ in reports[0].values())


def _virtual_stages_case(order):
    """Two stages on each of 2 ranks ("loop": 0, 2 and 1, 3; "v": 0, 3 and 1, 2): messages in
    both directions, and in a V the middle stages on one rank."""
    state = tp_ext.init_parallel(tp=1, pp=2)
    reference = _reference("llama")
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state,
                               virtual_stages=2, stage_order=order)  # fmt: skip
    engine = _engine(model, state)
    for i, prompt in enumerate(_prompts()):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=NEW, temperature=0))
    got = _drain(engine)
    for i, prompt in enumerate(_prompts()):
        assert got[str(i)] == _greedy_reference(reference, prompt), (order, i)


@pytest.mark.parametrize("order", ["loop", pytest.param("v", marks=pytest.mark.full_matrix)])
def test_virtual_stages_decode_as_transformers(order):
    run_distributed(_virtual_stages_case, 2, order)


def _sampled_case(tp):
    state = tp_ext.init_parallel(tp=tp)
    model = tp_ext.parallelize(copy.deepcopy(_reference("llama")), "auto", parallel=state)
    sampled = SamplingParams(max_tokens=NEW, temperature=0.8, top_k=20, top_p=0.9, seed=7,
                             ignore_eos=True)  # fmt: skip
    alone = _engine(model, state)
    alone.add_request("s", [5, 6, 7], sampled)
    crowded = _engine(model, state)  # the same request among others, and a second seed
    for i, prompt in enumerate(_prompts()):
        crowded.add_request(str(i), prompt, SamplingParams(max_tokens=NEW, temperature=0))
    crowded.add_request("s", [5, 6, 7], sampled)
    crowded.add_request("t", [5, 6, 7], SamplingParams(**{**sampled.__dict__, "seed": 8}))
    a, b = _drain(alone), _drain(crowded)
    assert a["s"] == b["s"], (a["s"], b["s"])
    return a["s"], b["t"]


def test_a_seeded_request_samples_the_same_tokens_at_any_tp():
    one = run_distributed(_sampled_case, 1, 1)[0]
    for tp in (2, 3):
        assert run_distributed(_sampled_case, tp, tp)[0] == one, tp
    assert one[0] != one[1]  # another seed, other tokens


def _abort_case():
    state = tp_ext.init_parallel(tp=2)
    model = tp_ext.parallelize(copy.deepcopy(_reference("llama")), "auto", parallel=state)
    engine = _engine(model, state, prefix_caching=False)
    engine.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=NEW, temperature=0))
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=NEW, temperature=0))
    assert engine.step() == []  # a's first 16 prompt tokens
    first = [out.token for out in engine.step() if out.request_id == "b"]  # a's last 13, b's 3
    held = engine.pool.used
    out = engine.abort("a")
    assert out.finish_reason is FinishReason.ABORT and engine.abort("a") is None
    assert (held, engine.pool.used) == (8 + 1, 1)  # a's 29 positions went, b's 3 stay
    assert first + _drain(engine)["b"] == _greedy_reference(_reference("llama"), [5, 6, 7])
    return engine.pool.used


def test_a_cancelled_request_frees_its_blocks_at_once():
    assert run_distributed(_abort_case, 2) == [0, 0]


def _refusals_case():
    state = tp_ext.init_parallel(tp=1)
    model = tp_ext.parallelize(copy.deepcopy(_reference("llama")), "auto", parallel=state)
    engine = _engine(model, state, num_blocks=8)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    cases = [
        ([], greedy, "prompt must be 1 or more token ids"),
        ([VOCAB], greedy, f"token ids in [0, {VOCAB})"),
        ([1] * 62, greedy, "this model's context is 64 tokens; the prompt's 62 tokens"),
        ([1], SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
        ([1], SamplingParams(max_tokens=1, top_p=1.5), "top_p must be in (0, 1]"),
        ([1] * 60, SamplingParams(max_tokens=4), "need 16 KV-cache blocks, the cache has 8"),
    ]
    seen = []
    for prompt, params, message in cases:
        with pytest.raises(ValueError, match=None) as caught:
            engine.add_request("x", prompt, params)
        seen.append(message in str(caught.value) or str(caught.value))
    engine.add_request("x", [1], greedy)
    with pytest.raises(ValueError, match="request_id 'x' is already running"):
        engine.add_request("x", [2], greedy)
    return seen


def test_bad_requests_are_refused_by_name():
    assert run_distributed(_refusals_case, 1)[0] == [True] * 6


def test_block_pool_shares_prefixes_and_evicts_the_oldest_unused():
    pool = BlockPool(4, 2)
    tokens = [1, 2, 3, 4, 5]
    first = pool.allocate(3)
    pool.remember(tokens, first, 4)  # two full blocks computed
    assert pool.cached_prefix(tokens) == first[:2] and pool.prefix_hits == 2
    pool.release(first[:2])  # the second user of the two blocks is done
    assert pool.used == 3
    pool.release(first)  # all done: the two cached blocks stay findable, the third is free
    assert pool.used == 0 and pool.available == 4
    assert pool.allocate(2) is not None  # the free ones first...
    taken = pool.allocate(2)  # ...then the cached ones, oldest first, forgetting their prefix
    assert taken == first[:2] and pool.cached_prefix(tokens) == []
    assert pool.allocate(1) is None
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16)


def _replicas_case(tp, dp):
    """The engine loop as ``tp-ext serve`` runs it: rank 0 hands requests out to ``dp``
    replicas of ``tp`` ranks; each request's tokens are still transformers' greedy ones."""
    import threading

    from tp_ext.serving.coordinator import EngineLoop

    state = tp_ext.init_parallel(tp=tp, dp=dp)
    reference = _reference("llama")
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)
    loop = EngineLoop(_engine(model, state), replica=state.dp_rank, replicas=dp,
                      leader=state.tp_rank == 0)  # fmt: skip
    prompts, tokens, replicas = _prompts(), {}, set()
    done = threading.Event()

    def listener(i):
        def on(out):
            if out.token is not None:
                tokens.setdefault(i, []).append(out.token)
            if out.finish_reason is not None and len(tokens) == len(prompts) and not loop.listeners:
                done.set()

        return on

    def drive():
        for i, prompt in enumerate(prompts):
            loop.submit(str(i), prompt, SamplingParams(max_tokens=NEW, temperature=0), listener(i))
            replicas.add(loop.assigned[str(i)])
        done.wait(120)
        loop.stop()

    if torch.distributed.get_rank() == 0:
        threading.Thread(target=drive, daemon=True).start()
    loop.run()
    if torch.distributed.get_rank() == 0:
        assert replicas == set(range(dp)), replicas  # every replica served some
        for i, prompt in enumerate(prompts):
            assert tokens[i] == _greedy_reference(reference, prompt), i
    return loop.engine.pool.used


@pytest.mark.parametrize("tp,dp", [(1, 2), pytest.param(2, 2, marks=pytest.mark.full_matrix)])
def test_data_parallel_replicas_behind_one_loop(tp, dp):
    assert run_distributed(_replicas_case, tp * dp, tp, dp) == [0] * (tp * dp)


def _plan_case():
    """The planner's bytes per rank against the converted model's and the engine's cache
    (the planner's excess over this rank's)."""
    from tp_ext.planner.serving import plan_serving

    state = tp_ext.init_parallel(tp=2)
    reference = _reference("llama")
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)
    engine = _engine(model, state, num_blocks=3 * 64 // 4)  # 3 requests at the full context
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    _drain(engine)
    slot = engine.cache.nbytes() // (engine.cache.scratch + 1)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ranked = plan_serving(reference.config, world=2, memory=2**40, max_num_seqs=3, context=64,
                          dtype="float64")  # fmt: skip
    mine = next(e for e in ranked if e.tp == 2)
    return mine.weight_bytes - weights, mine.kv_cache_bytes - slot * engine.cache.scratch


def test_the_planner_counts_a_ranks_weights_and_kv_cache_exactly():
    (weights, cache), (other, other_cache) = run_distributed(_plan_case, 2)
    assert (weights, cache, other_cache) == (0, 0, 0)  # rank 0 holds the largest shards
    assert other == 2 * 48 * 8  # rank 1: one vocabulary row fewer in the embedding and head


def test_the_planner_picks_dims_that_fit_and_decode_fastest():
    from tp_ext.planner.serving import plan_serving

    config = _reference("llama").config
    plan = lambda memory: plan_serving(config, world=2, memory=memory, max_num_seqs=4,  # noqa: E731
                                       context=64, dtype="float64")  # fmt: skip
    roomy = plan(2**40)
    assert all(e.fits for e in roomy) and {(e.tp, e.dp) for e in roomy} == {(1, 2), (2, 1)}
    assert roomy[0].tokens_per_s == max(e.tokens_per_s for e in roomy)
    one, two = (next(e for e in roomy if e.tp == t) for t in (1, 2))
    assert one.weight_bytes > two.weight_bytes and one.kv_cache_bytes == 2 * two.kv_cache_bytes
    # room for tp=2's rank but not tp=1's: tp=2 first, tp=1 refused with its bytes
    from tp_ext.planner.candidate import RESERVED_BYTES, USABLE_FRACTION

    need = lambda e: e.weight_bytes + e.kv_cache_bytes  # noqa: E731
    memory = int((need(two) + RESERVED_BYTES + 1) / USABLE_FRACTION) + 1
    tight = plan(memory)
    assert (tight[0].tp, tight[0].fits) == (2, True) and not tight[1].fits
    assert "GiB a rank" in tight[1].reason
