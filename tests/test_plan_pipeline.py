"""``tp-ext plan`` over TP x PP (x DP): per-stage and per-rank parameter counts and bytes of
Qwen2-72B on the meta device, checked against the per-layer formula of
../shared/docs/qwen-72b.md and against a TP-only meta model's parameters grouped by stage."""

import json
import os
import re

import pytest

from tp_ext.cli import main
from tp_ext.config import JobConfig
from tp_ext.layers import ResolvedGroup
from tp_ext.models import Qwen2ForCausalLM
from tp_ext.models.footprint import format_pipeline_footprint, pipeline_footprint
from tp_ext.validation import ArgumentError

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
Q72 = os.path.join(CONFIGS, "qwen2-72b.yaml")
MINI = os.path.join(CONFIGS, "qwen2-mini.yaml")

TOTAL = 72_706_203_648  # qwen-72b.md
H, LAYERS = 8192, 80
# One decoder layer's shard at tp=8 (qwen-72b.md: 8 query heads and 1 KV head of 128 per rank,
# MLP 3696 per rank): q, k, v rows with their biases, o_proj, gate + up + down, two norms.
LAYER_TP8 = (1024 + 128 + 128) * (H + 1) + 1024 * H + 3 * 3696 * H + 2 * H
EMBED_TP8 = 19008 * H  # vocab 152064 / 8
HEAD_TP8 = 19008 * H + H  # LM head shard and the final norm
NORMS = (2 * LAYERS + 1) * H  # every norm of the model: replicated on each TP rank


def _config(path):
    return JobConfig.from_file(path).model


@pytest.fixture(scope="module")
def q72():
    return _config(Q72)


@pytest.fixture(scope="module")
def tp_only_tp8(q72):
    """TP rank 0's shard of the whole model (no pipeline): numel per layer index (None for the
    embedding, norm and head), summed later over whatever stages a stage split makes."""
    model = Qwen2ForCausalLM(q72, ResolvedGroup.virtual(8, 0), device="meta")
    per = {}
    for name, p in model.named_parameters():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        key = int(m.group(1)) if m else name
        per[key] = per.get(key, 0) + p.numel()
    return per


def _grouped(per, layer_counts):
    """Stage sums of a TP-only model's parameters for this split of the layers."""
    sums, start = [], 0
    for stage, count in enumerate(layer_counts):
        total = sum(per[i] for i in range(start, start + count))
        if stage == 0:
            total += per["model.embed_tokens.weight"]
        if stage == len(layer_counts) - 1:
            total += per["model.norm.weight"] + per["lm_head.weight"]
        sums.append(total)
        start += count
    return sums


def _check_totals(fp):
    assert fp["parameters_total"] == TOTAL
    every = sum(r["parameters"] for s in fp["stages"] for r in s["tp_ranks"])
    assert every == fp["parameters_all_shards"] == TOTAL + fp["replicated"]["parameters"]
    assert sum(r["parameters"] for r in fp["ranks"]) == every
    assert fp["bytes_all_shards"] == 2 * every  # bfloat16
    for s in fp["stages"]:
        assert all(r["bytes"] == 2 * r["parameters"] for r in s["tp_ranks"])


def test_tp8_pp4_exact(q72, tp_only_tp8):
    assert LAYER_TP8 == 109_724_928
    fp = pipeline_footprint(q72, tp=8, pp=4)
    assert fp["layer_counts"] == [20, 20, 20, 20] and fp["num_stages"] == 4
    assert fp["world_size"] == 32
    expected = [
        20 * LAYER_TP8 + EMBED_TP8,
        20 * LAYER_TP8,
        20 * LAYER_TP8,
        20 * LAYER_TP8 + HEAD_TP8,
    ]
    assert expected == [2_350_212_096, 2_194_498_560, 2_194_498_560, 2_350_220_288]
    assert expected == _grouped(tp_only_tp8, [20] * 4)
    for s, want in zip(fp["stages"], expected):
        assert (s["first_layer"], s["last_layer"]) == (20 * s["stage"], 20 * s["stage"] + 19)
        assert s["pp_rank"] == s["stage"]
        assert [r["parameters"] for r in s["tp_ranks"]] == [want] * 8
        assert s["tp_ranks"][0]["bytes"] == 2 * want
        assert s["tp_ranks"][0]["kv_cache_bytes_per_token"] == 2 * 20 * 1 * 128 * 2
    assert [s["embedding"] for s in fp["stages"]] == [True, False, False, False]
    assert [s["head"] for s in fp["stages"]] == [False, False, False, True]
    # the per-rank view: rank (pp 3, tp 5) holds stage 3 only, global rank 3*8 + 5
    r = fp["ranks"][3 * 8 + 5]
    assert (r["pp_rank"], r["tp_rank"], r["stages"], r["global_ranks"]) == (3, 5, [3], [29])
    assert r["parameters"] == expected[3]
    _check_totals(fp)
    # nothing but the norms is replicated at tp=8 (8 KV heads, one per rank)
    assert fp["replicated"]["parameters"] == 7 * NORMS == 9_232_384
    assert fp["replicated"]["bytes"] == 18_464_768
    assert set(fp["replicated"]["by_tensor"]) == {
        "model.layers.*.input_layernorm.weight",
        "model.layers.*.post_attention_layernorm.weight",
        "model.norm.weight",
    }
    assert fp["max_rank_bytes"] == 2 * expected[3]
    # the TP-only footprint's per-rank count is the sum over the four stages
    assert sum(expected) == 9_089_429_504
    text = format_pipeline_footprint(fp)
    assert "2,350,220,288" in text and "9,232,384" in text and "60-79" in text


def test_tp8_pp3_uneven(q72, tp_only_tp8):
    fp = pipeline_footprint(q72, tp=8, pp=3)
    assert fp["layer_counts"] == [27, 27, 26]  # earlier stages take the extra layer
    expected = [27 * LAYER_TP8 + EMBED_TP8, 27 * LAYER_TP8, 26 * LAYER_TP8 + HEAD_TP8]
    assert expected == _grouped(tp_only_tp8, [27, 27, 26])
    assert [s["tp_ranks"][7]["parameters"] for s in fp["stages"]] == expected
    assert [(s["first_layer"], s["last_layer"]) for s in fp["stages"]] == [
        (0, 26),
        (27, 53),
        (54, 79),
    ]
    _check_totals(fp)
    assert fp["replicated"]["parameters"] == 7 * NORMS
    # an explicit split moves layers between stages
    fp = pipeline_footprint(q72, tp=8, pp=3, pipeline_split=[26, 28, 26])
    assert [s["parameters"] for s in fp["stages"]] == [
        8 * x for x in _grouped(tp_only_tp8, [26, 28, 26])
    ]


def test_virtual_stages_loop_and_v(q72, tp_only_tp8):
    fp = pipeline_footprint(q72, tp=8, pp=4, virtual_stages=2)
    assert fp["num_stages"] == 8 and fp["layer_counts"] == [10] * 8
    stage = _grouped(tp_only_tp8, [10] * 8)
    by_rank = {r["pp_rank"]: r for r in fp["ranks"] if r["tp_rank"] == 0}
    # loop order: rank r holds stages r and r + 4
    assert [by_rank[p]["stages"] for p in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert by_rank[0]["parameters"] == stage[0] + stage[4] == 20 * LAYER_TP8 + EMBED_TP8
    assert by_rank[3]["parameters"] == 20 * LAYER_TP8 + HEAD_TP8
    _check_totals(fp)
    fp = pipeline_footprint(q72, tp=8, pp=4, virtual_stages=2, stage_order="v")
    by_rank = {r["pp_rank"]: r for r in fp["ranks"] if r["tp_rank"] == 0}
    assert [by_rank[p]["stages"] for p in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [s["pp_rank"] for s in fp["stages"]] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert by_rank[0]["parameters"] == 20 * LAYER_TP8 + EMBED_TP8 + HEAD_TP8
    assert by_rank[1]["parameters"] == by_rank[3]["parameters"] == 20 * LAYER_TP8
    _check_totals(fp)


def test_kv_heads_replicated_when_tp_exceeds_them(q72):
    fp = pipeline_footprint(q72, tp=16, pp=2, dp=2)
    # 8 KV heads on 16 ranks: each k and v head (128 rows of 8192 plus its bias) held twice
    kv_extra = LAYERS * 8 * 2 * 128 * (H + 1)
    assert fp["replicated"]["parameters"] == 15 * NORMS + kv_extra == 1_362_124_800
    by = fp["replicated"]["by_tensor"]
    assert by["model.layers.*.self_attn.qkv_proj.weight"]["parameters"] == LAYERS * 8 * 2 * 128 * H
    assert by["model.layers.*.self_attn.qkv_proj.bias"]["parameters"] == LAYERS * 8 * 2 * 128
    assert "num_key_value_heads=8 < tp=16" in by["model.layers.*.self_attn.qkv_proj.bias"]["reason"]
    _check_totals(fp)
    assert fp["world_size"] == 64
    assert fp["ranks"][16 + 3]["global_ranks"] == [35, 51]  # mesh (pp, dp, tp): pp 1, tp 3
    assert fp["bytes_all_ranks_with_dp"] == 2 * fp["bytes_all_shards"]


def test_tied_embedding_copy_and_uneven_tp():
    """A tied model under pipelining keeps a copy of the embedding on the last stage; the
    mini model at tp=3 has an uneven vocabulary, MLP and KV heads."""
    config = _config(MINI).replace(tie_word_embeddings=True, num_hidden_layers=3)
    fp = pipeline_footprint(config, tp=3, pp=2, dtype="float32")
    total = sum(p.numel() for p in Qwen2ForCausalLM(config, device="meta").parameters())
    per_tp = [
        sum(
            p.numel()
            for p in Qwen2ForCausalLM(
                config, ResolvedGroup.virtual(3, r), device="meta"
            ).parameters()
        )
        for r in range(3)
    ]
    assert fp["parameters_total"] == total
    assert fp["layer_counts"] == [2, 1]
    copy = config.vocab_size * config.hidden_size
    assert fp["replicated"]["by_tensor"]["lm_head.weight"]["parameters"] == copy
    assert "tied" in fp["replicated"]["by_tensor"]["lm_head.weight"]["reason"]
    assert fp["parameters_all_shards"] == sum(per_tp) + copy
    assert fp["parameters_all_shards"] == total + fp["replicated"]["parameters"]
    ranks = [[r["parameters"] for r in fp["ranks"] if r["tp_rank"] == t] for t in range(3)]
    vocab_rows = [334, 334, 333]  # 1001 over 3
    for t in range(3):
        assert sum(ranks[t]) == per_tp[t] + vocab_rows[t] * config.hidden_size
        assert fp["ranks"][t]["bytes"] == 4 * fp["ranks"][t]["parameters"]


def test_cli_json(q72, tp_ext_here):
    status, out, _ = tp_ext_here("plan", Q72, "--tp", 8, "--pp", 4, "--dp", 2, "--json")
    assert status == 0
    fp = json.loads(out)
    assert (fp["tp"], fp["pp"], fp["dp"], fp["world_size"]) == (8, 4, 2, 64)
    assert [s["tp_ranks"][7]["parameters"] for s in fp["stages"]] == [
        2_350_212_096,
        2_194_498_560,
        2_194_498_560,
        2_350_220_288,
    ]
    assert fp["stages"][3]["tp_ranks"][7]["bytes"] == 4_700_440_576
    assert fp["replicated"] == pipeline_footprint(q72, tp=8, pp=4, dp=2)["replicated"]
    assert fp["ranks"][8]["global_ranks"] == [16, 24]  # pp 1, tp 0
    _check_totals(fp)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--pp", "81"],
            "argument --pp: pp=81 x virtual_stages=1 = 81 pipeline stages, but the model has 80 "
            "decoder layers and every stage needs at least one: use pp <= 80 (pp that split the "
            "layers evenly with virtual_stages=1: [1, 2, 4, 5, 8, 10, 16, 20, 40, 80])",
        ),
        (["--pp", "41", "--virtual-stages", "2"], "argument --pp: pp=41 x virtual_stages=2 = 82"),
        (
            ["--pp", "4", "--pipeline-split", "20,20,20"],
            "argument --pipeline-split: pipeline_split lists 3 stages ([20, 20, 20]) but pp=4 x "
            "virtual_stages=1 makes 4: give 4 layer counts, or pp=3 for 3 stages; the default "
            "split would be [20, 20, 20, 20]",
        ),
        (
            ["--pp", "4", "--pipeline-split", "20,20,20,21"],
            "argument --pipeline-split: pipeline_split must give every stage at least one layer "
            "and sum to the model's 80 decoder layers; got [20, 20, 20, 21] (sum 81)",
        ),
        (
            ["--tp", "100", "--pp", "4"],
            "argument --tp: tp=100 cannot split 64 attention heads / 8 KV heads; use one of "
            "[1, 2, 3,",
        ),
        (
            ["--pp", "4", "--stage-order", "v"],
            "argument --virtual-stages: stage_order='v' puts two stages on each pipeline rank: "
            "it needs virtual_stages=2, got virtual_stages=1",
        ),
    ],
)
def test_bad_values_name_the_flag(flags, message, capsys):
    assert main(["plan", Q72, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tp-ext plan: ") and message in err


def test_bad_split_text_is_refused_by_the_parser(capsys):
    for text in ("a,b", "0,40,40", ""):
        with pytest.raises(SystemExit) as e:
            main(["plan", Q72, "--pp", "3", "--pipeline-split", text])
        assert e.value.code == 2
        assert "argument --pipeline-split: must be the decoder layers of each stage" in (
            capsys.readouterr().err
        )


def test_library_errors_name_the_argument(q72):
    with pytest.raises(ArgumentError, match=r"dp must be an int >= 1, got 0") as e:
        pipeline_footprint(q72, tp=8, pp=4, dp=0)
    assert e.value.argument == "dp"
    with pytest.raises(ArgumentError, match=r"pipeline_split must be a list of layer counts") as e:
        pipeline_footprint(q72, tp=8, pp=2, pipeline_split="40,40")
    assert e.value.argument == "pipeline_split"
    with pytest.raises(ArgumentError, match=r"dtype must be one of") as e:
        pipeline_footprint(q72, tp=8, dtype="fp8")
    assert e.value.argument == "dtype"


def test_the_footprints_errors_name_the_argument_and_travel(q72):
    """The footprint's errors are ArgumentErrors (ConfigErrors naming the argument), which
    survive pickling, as they do when raised on a spawned rank."""
    import pickle

    from tp_ext.validation import ConfigError

    assert issubclass(ArgumentError, ConfigError)
    with pytest.raises(ArgumentError, match="pp must be an int >= 1, got 0") as e:
        pipeline_footprint(q72, tp=8, pp=0)
    copy = pickle.loads(pickle.dumps(e.value))  # as raised on a spawned rank
    assert (copy.argument, str(copy)) == ("pp", str(e.value))
