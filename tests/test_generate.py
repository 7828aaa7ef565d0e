"""``tp_ext.generate`` (tp_ext/generation/): a left-padded batch of prompts of lengths 3 to 40
gives transformers' own greedy tokens at TP = 1..4, (tp, pp) = (2, 2) and (1, 3), for Hugging
Face Llama, Qwen2 and Mixtral (with expert parallelism) converted by ``parallelize`` and for
tp_ext's native Qwen2; each row stops at its EOS (then padded) as transformers' rows do; sampled
tokens equal a single-process reference applying the same rule with the same draws, at all
dims; the KV cache's bytes per rank are as its shape says; bad arguments fail on every rank.
"""

import copy
import os

import pytest
import torch
import transformers

import tp_ext

from .dist_utils import run_distributed
from .test_parallelize_models import COMMON, VOCAB

NEW = 8
CONFIG = {**COMMON, "num_hidden_layers": 4, "max_position_embeddings": 64}
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # fp32: its grouped expert GEMMs have no fp64 kernel
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
}


def _reference(arch: str):
    config_class, model_class, extra = ARCHS[arch]
    config = getattr(transformers, config_class)(**{**CONFIG, **extra})
    torch.manual_seed(0)  # the same full weights on every rank
    dtype = torch.float32 if arch == "mixtral" else torch.float64
    return getattr(transformers, model_class)(config).to(dtype).eval()


def _prompts(batch: int = 5, seed: int = 1):
    """Left-padded prompts of lengths 3 to 40 (``(ids, mask)``, 0 at the padding)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(3, 40, batch).long().tolist()
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, VOCAB, (n,), generator=generator)
        mask[row, width - n :] = 1
    return ids, mask


def _native(reference, state, directory):
    """tp_ext's Qwen2 with ``reference``'s weights (through a checkpoint, as users load it)."""
    from tp_ext.models.qwen2 import Qwen2ForCausalLM

    path = os.path.join(directory, "qwen2")
    if torch.distributed.get_rank() == 0:
        reference.save_pretrained(path)
    torch.distributed.barrier()
    return Qwen2ForCausalLM.from_pretrained(
        path, parallel=state, dtype=reference.dtype, progress=False
    )


def _greedy_case(tp, pp, ep, dp, archs, directory=None):
    state = tp_ext.init_parallel(tp=tp, pp=pp, ep=ep, dp=dp)
    ids, mask = _prompts()
    checked = []
    for arch in archs:
        reference = _reference(arch)
        want = reference.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
        model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)
        got = tp_ext.generate(model, ids, mask, max_new_tokens=NEW)
        assert torch.equal(got, want), (arch, got, want)
        checked.append(arch)
        if arch == "qwen2" and directory is not None:
            got = tp_ext.generate(_native(reference, state, directory), ids, mask, NEW)
            assert torch.equal(got, want), ("native qwen2", got, want)
            checked.append("native")
    return checked


GREEDY = [  # (tp, pp) with the dense models
    (1, 1),
    (2, 1),
    (3, 1),
    (4, 1),
    (2, 2),
    (1, 3),
]
FAST = {(2, 1), (3, 1), (2, 2), (1, 3)}


@pytest.mark.parametrize(
    "tp,pp",
    [pytest.param(*dims, marks=() if dims in FAST else pytest.mark.full_matrix) for dims in GREEDY],
)
def test_greedy_equals_transformers(tp, pp, tmp_path):
    archs = ["llama", "qwen2"]
    checked = run_distributed(_greedy_case, tp * pp, tp, pp, 1, 1, archs, str(tmp_path))
    assert checked[0] == ["llama", "qwen2", "native"]


@pytest.mark.parametrize(
    "tp,pp,ep,dp",
    [
        (2, 1, 2, 1),  # experts over the TP ranks
        (1, 2, 2, 2),  # experts over data replicas, inside pipeline stages (forwards in step)
        pytest.param(1, 1, 2, 2, marks=pytest.mark.full_matrix),
        pytest.param(2, 2, 2, 1, marks=pytest.mark.full_matrix),
    ]
    + [  # without expert parallelism, all dims of the dense models
        pytest.param(tp, pp, 1, 1, marks=pytest.mark.full_matrix) for tp, pp in GREEDY
    ],
)
def test_mixtral_greedy_equals_transformers(tp, pp, ep, dp):
    run_distributed(_greedy_case, tp * pp * dp, tp, pp, ep, dp, ["mixtral"])


def _grid_case(grid, pp, directory):
    """tp_ext's 2D Qwen2 (a P x Q grid, in pipeline stages at pp > 1): greedy tokens equal
    transformers'; sampled ones the single-process rule's with the same draws."""
    state = tp_ext.init_parallel(tp=grid, pp=pp)
    reference = _reference("qwen2")
    ids, mask = _prompts()
    model = _native(reference, state, directory)
    assert model.loss_kind is tp_ext.contract.LossKind.GRID_BLOCK  # the 2D model
    want = reference.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0
    )
    got, report = tp_ext.generate(model, ids, mask, max_new_tokens=NEW, return_report=True)
    assert torch.equal(got, want), (got, want)
    assert report["kv_cache_bytes"] > 0
    rule = RULES[3]
    want = _reference_sample(reference, ids, mask, NEW, seed=7, **rule)
    got = tp_ext.generate(model, ids, mask, NEW, do_sample=True, seed=7, **rule)
    assert torch.equal(got, want), (rule, got, want)
    return state.tp_grid.shape


@pytest.mark.parametrize(
    "grid, pp",
    [((2, 1), 1), ((1, 2), 2), pytest.param((2, 2), 1, marks=pytest.mark.full_matrix)],
    ids=str,
)
def test_the_2d_model_decodes_like_transformers(grid, pp, tmp_path):
    world = grid[0] * grid[1] * pp
    assert run_distributed(_grid_case, world, grid, pp, str(tmp_path))[0] == grid


def _virtual_stages_case(order, micro_batches):
    """Two stages on each of 2 ranks ("loop": 0, 2 and 1, 3; "v": 0, 3 and 1, 2): each stage's
    own KV cache, messages in both directions between the two ranks."""
    state = tp_ext.init_parallel(tp=1, pp=2)
    ids, mask = _prompts()
    for arch in ("llama", "mixtral"):
        reference = _reference(arch)
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
        model = tp_ext.parallelize(
            copy.deepcopy(reference),
            "auto",
            parallel=state,
            virtual_stages=2,
            stage_order=order,
        )
        got = tp_ext.generate(model, ids, mask, NEW, micro_batches=micro_batches)
        assert torch.equal(got, want), (arch, order, got, want)


@pytest.mark.parametrize("order,micro_batches", [("loop", 2), ("v", 2), ("loop", 1)])
def test_virtual_stages_equal_transformers(order, micro_batches):
    run_distributed(_virtual_stages_case, 2, order, micro_batches)


def _eos_case(tp, pp, micro_batches):
    """Rows that end at different steps (an EOS each row reaches at its own time)."""
    state = tp_ext.init_parallel(tp=tp, pp=pp)
    reference = _reference("llama")
    ids, mask = _prompts()
    free = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
    eos = [int(free[0, -NEW + 1]), int(free[3, -NEW + 4])]  # row 0 ends at step 2, row 3 at 5
    want = reference.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=VOCAB - 1
    )
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)
    got = tp_ext.generate(
        model,
        ids,
        mask,
        max_new_tokens=NEW,
        eos_token_id=eos,
        pad_token_id=VOCAB - 1,
        micro_batches=micro_batches,
    )
    assert torch.equal(got, want), (got, want)
    assert (got[0, -NEW + 2 :] == VOCAB - 1).all()  # padded after its EOS
    # every row ending early: the loop stops with them, as transformers' does
    early = [int(t) for t in free[:, ids.size(1)]]  # each row's first new token
    want = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=early)
    got = tp_ext.generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=early)
    assert got.size(1) == ids.size(1) + 1 and torch.equal(got, want), (got, want)


@pytest.mark.parametrize("tp,pp,micro_batches", [(1, 1, None), (2, 2, None), (1, 2, 1)])
def test_eos_ends_rows_as_transformers(tp, pp, micro_batches):
    run_distributed(_eos_case, tp * pp, tp, pp, micro_batches)


def _hf_generate_case(tp):
    """transformers' own generate on a converted model gives tp_ext.generate's tokens."""
    state = tp_ext.init_parallel(tp=tp)
    reference = _reference("qwen2")
    ids, mask = _prompts()
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
    ours, report = tp_ext.generate(model, ids, mask, max_new_tokens=NEW, return_report=True)
    assert torch.equal(ours, theirs)
    # the KV cache: every layer's keys and values for this rank's KV heads, once
    kv_local = tp_ext.shard_sizes(CONFIG["num_key_value_heads"], tp)[state.tp_rank] or 1
    head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    length = ids.size(1) + NEW
    element = reference.dtype.itemsize
    expected = CONFIG["num_hidden_layers"] * 2 * ids.size(0) * kv_local * length * head_dim
    assert report["kv_cache_bytes"] == expected * element, report
    assert report["new_tokens"] == ids.size(0) * NEW and report["tokens_per_s"] > 0
    return report["kv_cache_bytes"]


def test_transformers_generate_on_converted_model_and_cache_bytes():
    run_distributed(_hf_generate_case, 2, 2)


# -- sampling ----------------------------------------------------------------------------------


def reference_choice(logits, uniform, temperature, top_k, top_p):
    """The sampling rule of tp_ext.layers.sampling on full logits [batch, V]: the chosen token
    of each row and the set it was drawn from (a bool mask)."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    s = logits.to(acc) / temperature
    keep = s > float("-inf")
    if top_k is not None:
        kth = s.topk(min(top_k, s.size(-1)), dim=-1).values[:, -1:]
        keep &= s >= kth
    row_max = s.max(dim=-1, keepdim=True).values
    weights = torch.where(keep, (s - row_max).exp(), torch.zeros_like(s))
    if top_p is not None and top_p < 1:
        ordered, order = s.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True)
        cumulative = (ordered - row_max).exp().cumsum(-1) / weights.sum(-1, keepdim=True)
        last = (cumulative < top_p).sum(-1, keepdim=True).clamp(max=s.size(-1) - 1)
        keep &= s >= ordered.gather(-1, last)
        weights = torch.where(keep, weights, torch.zeros_like(weights))
    running = weights.cumsum(-1)
    target = uniform.to(acc).unsqueeze(-1) * weights.sum(-1, keepdim=True)
    token = ((running <= target) | ~keep).long().cumprod(-1).sum(-1)  # first kept past target
    last_kept = keep.long() * torch.arange(1, s.size(-1) + 1)
    token = torch.where(token >= s.size(-1), last_kept.argmax(-1), token)
    return token, keep


def _reference_sample(reference, ids, mask, new, seed, **rule):
    """Single-process generation by the rule, with the draws tp_ext.generate makes."""
    generator = torch.Generator().manual_seed(seed)
    tokens, mask = ids, mask
    for _ in range(new):
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits = reference(tokens, attention_mask=mask, position_ids=positions).logits[:, -1]
        uniform = torch.rand(ids.size(0), dtype=torch.float64, generator=generator)
        token, keep = reference_choice(logits, uniform, **rule)
        assert keep.gather(1, token.unsqueeze(1)).all()  # drawn from the kept set
        tokens = torch.cat([tokens, token.unsqueeze(1)], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return tokens


RULES = [
    dict(temperature=0.7, top_k=None, top_p=None),
    dict(temperature=1.3, top_k=5, top_p=None),
    dict(temperature=1.0, top_k=None, top_p=0.9),
    dict(temperature=0.8, top_k=20, top_p=0.6),
]


def _sample_case(tp, pp):
    state = tp_ext.init_parallel(tp=tp, pp=pp)
    reference = _reference("llama")
    ids, mask = _prompts()
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)
    for i, rule in enumerate(RULES):
        want = _reference_sample(reference, ids, mask, NEW, seed=10 + i, **rule)
        got = tp_ext.generate(model, ids, mask, NEW, do_sample=True, seed=10 + i, **rule)
        assert torch.equal(got, want), (rule, got, want)
    # top_k=1 is greedy
    greedy = tp_ext.generate(model, ids, mask, NEW)
    assert torch.equal(tp_ext.generate(model, ids, mask, NEW, do_sample=True, top_k=1), greedy)


@pytest.mark.parametrize(
    "tp,pp",
    [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2)],
)
def test_sampling_equals_reference_with_the_same_draws(tp, pp):
    run_distributed(_sample_case, tp * pp, tp, pp)


def _shard_sample_case(vocab, rows):
    """vocab_parallel_sample / vocab_parallel_argmax on random logits against the rule."""
    from tp_ext.layers.sampling import vocab_parallel_argmax, vocab_parallel_sample

    state = tp_ext.init_parallel(tp=torch.distributed.get_world_size())
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64)
    logits[0] *= 0.01  # nearly flat: the top-p nucleus is most of the vocabulary
    logits[1, 7] = logits[1].max() + 1  # a tie for the maximum in the next row
    logits[2, 9] = logits[2, 7] = logits[2].max() + 1
    uniform = torch.rand(rows, dtype=torch.float64, generator=generator)
    shard = tp_ext.split_tensor(logits, -1, state.tp)[state.tp_rank]
    assert torch.equal(vocab_parallel_argmax(shard, vocab, state.tp_group), logits.argmax(-1))
    for rule in RULES + [dict(temperature=1.0, top_k=vocab + 5, top_p=0.999)]:
        got = vocab_parallel_sample(shard, uniform, vocab, tp_group=state.tp_group, **rule)
        want, _ = reference_choice(logits, uniform, **rule)
        assert torch.equal(got, want), (rule, got, want)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_vocab_parallel_sample_any_tp(world):
    run_distributed(_shard_sample_case, world, 1000, 6)


# -- errors ------------------------------------------------------------------------------------


def _errors_case():
    state = tp_ext.init_parallel(tp=torch.distributed.get_world_size())
    model = tp_ext.parallelize(copy.deepcopy(_reference("llama")), "auto", parallel=state)
    ids, mask = _prompts()
    right = mask.flip(-1)
    cases = [
        (dict(max_new_tokens=NEW, max_cache_len=ids.size(1)), "KV cache"),
        (dict(max_new_tokens=CONFIG["max_position_embeddings"]), "max_position_embeddings"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=NEW, do_sample=True, temperature=0.0), "temperature"),
        (dict(max_new_tokens=NEW, do_sample=True, top_p=1.5), "top_p"),
        (dict(max_new_tokens=NEW, do_sample=True, top_k=0), "top_k"),
        (dict(max_new_tokens=NEW, attention_mask=right), "left-padded"),
        (dict(max_new_tokens=NEW, eos_token_id=VOCAB), "eos_token_id"),
        (dict(max_new_tokens=NEW, micro_batches=ids.size(0) + 1), "micro_batches"),
    ]
    seen = []
    for kwargs, words in cases:
        kwargs.setdefault("attention_mask", mask)
        with pytest.raises(ValueError, match=words) as error:
            tp_ext.generate(model, ids, **kwargs)
        seen.append(str(error.value))
    with pytest.raises(ValueError, match="input_ids must lie in"):
        tp_ext.generate(model, ids + VOCAB, max_new_tokens=1)
    rank = torch.distributed.get_rank()
    rows = [1, 0, 2, 3, 4] if rank else [0, 1, 2, 3, 4]  # one rank's prompts in another order
    with pytest.raises(ValueError, match="different prompts"):
        tp_ext.generate(model, ids[rows], mask[rows], NEW)
    with pytest.raises(ValueError, match="different generation settings"):
        tp_ext.generate(model, ids, mask, NEW + rank)
    with pytest.raises(ValueError, match="pad_token_id"):
        tp_ext.generate(model, ids, mask, NEW, pad_token_id=VOCAB)
    with pytest.raises(ValueError, match="temperature"):
        tp_ext.generate(model, ids, mask, NEW, do_sample=True, temperature=1e-30)
    return seen


def test_bad_arguments_fail_on_every_rank():
    seen = run_distributed(_errors_case, 2)
    assert seen[0] == seen[1]


# -- tp-ext generate ---------------------------------------------------------------------------


def _checkpoint_with_tokenizer(directory) -> str:
    """A Llama checkpoint with a word-level tokenizer ("w0".."w100"; "<eos>" is w2's id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB)}
    words["<eos>"], words["<pad>"] = words.pop("w2"), words.pop("w0")
    backend = Tokenizer(models.WordLevel(words, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="w1"
    )
    path = os.path.join(directory, "llama")
    reference = _reference("llama")
    reference.config.eos_token_id, reference.config.pad_token_id = 2, 0
    reference.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _generate_command(nproc: int, *argv) -> dict:
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), "-m", "tp_ext", "generate", *map(str, argv), "--json"],
        capture_output=True, text=True, timeout=400, cwd=root,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


PROMPTS = ["w5 w6 w7", "w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20", "w40"]


@pytest.mark.parametrize(
    "nproc,flags",
    [
        (2, ["--pp", "2"]),
        pytest.param(  # the prefill over CP, a split cache
            2, ["--cp", "2", "--cp-mode", "all_to_all"], marks=pytest.mark.full_matrix
        ),
        pytest.param(4, ["--tp", "2", "--pp", "2"], marks=pytest.mark.full_matrix),
    ],
)
def test_generate_command_prints_transformers_text(tmp_path, nproc, flags):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _checkpoint_with_tokenizer(tmp_path)
    argv = ["--model", path, *flags, "--max-new-tokens", 6, "--dtype", "float32"]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    result = _generate_command(nproc, *argv)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = reference.generate(**batch, max_new_tokens=6, do_sample=False)
    width = batch["input_ids"].size(1)
    assert result["outputs"] == tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    given = dict(zip(flags[::2], flags[1::2]))
    assert result["dims"]["pp"] == int(given.get("--pp", 1)) and result["tokens_per_s"] > 0
    assert result["dims"]["cp"] == int(given.get("--cp", 1))
    assert len(result["memory"]) == nproc and result["kv_cache_bytes_rank0"] > 0


def test_generate_command_refuses_cp_with_pipeline_stages(tmp_path, tp_ext_here):
    path = _checkpoint_with_tokenizer(tmp_path)
    status, _, err = tp_ext_here(
        "generate", "--model", path, "--cp", 2, "--pp", 2, "--prompt", "w5"
    )
    assert status == 2, err
    assert "--cp 2 with --pp 2: generation under context parallelism runs without pipeline" in err


@pytest.mark.full_matrix  # make test: the command by the text test, sampling by the library's
def test_generate_command_reads_token_ids_and_samples(tmp_path):
    """No tokenizer: a prompt file of token ids; sampled tokens equal the library call's."""
    reference = _reference("qwen2")
    path = os.path.join(tmp_path, "qwen2")
    reference.save_pretrained(path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5 6 7\n\n9 10 11 12 13\n")
    argv = ["--model", path, "--tp", 2, "--prompt-file", prompts, "--max-new-tokens", 5]
    argv += ["--do-sample", "--top-k", 10, "--temperature", 0.9, "--seed", 4, "--dtype", "float32"]
    result = _generate_command(2, *argv)
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    want = _reference_sample(
        reference.float(), ids, mask, 5, seed=4, temperature=0.9, top_k=10, top_p=None
    )
    eos = reference.config.eos_token_id
    assert eos is None or eos not in want[:, 5:]  # no row ends early: the rule alone decides
    assert result["outputs"] == want[:, 5:].tolist()
