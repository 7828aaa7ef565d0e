"""Every config field with bad values, through every way a config arrives: a tp_ext YAML job
file, direct construction, and a Hugging Face config.json. Each bad value must give the exact
message (field, value, what is allowed); each good form must read exactly."""

import json
import math
import os

import pytest
import yaml

from tp_ext.config import JobConfig, ParallelSettings
from tp_ext.models import ConfigError, Qwen2Config
from tp_ext.training import OptimizerSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "configs", "qwen2-mini.yaml")
GOOD = yaml.safe_load(open(MINI))

INT = "an integer in [1, {}] ({})"
VOCAB = INT.format("4,194,304", "16x the largest published vocabularies")
HIDDEN = INT.format("131,072", "8x the widest published models")
MLP = INT.format("1,048,576", "20x the widest published MLPs")
LAYERS = INT.format("512", "4x the deepest published models; a plan builds each")
HEADS = INT.format("4,096", "32x published models")
POSITIONS = INT.format("16,777,216", "512x Qwen2-72B's 32,768 tokens")
THETA = "a finite number > 0"
EPS = "a finite number in (0, 1)"
DEGREE = "an integer in [1, 65,536]"

# (section, field, bad value, what the message says is allowed, how the value is shown)
BAD = [
    ("model", "vocab_size", 0, VOCAB, "0"),
    ("model", "vocab_size", 2**22 + 1, VOCAB, "4194305"),
    ("model", "vocab_size", "1001", VOCAB, "'1001' (str)"),
    ("model", "vocab_size", None, VOCAB, "None (NoneType)"),
    ("model", "hidden_size", -64, HIDDEN, "-64"),
    ("model", "hidden_size", 64.0, HIDDEN, "64.0 (float)"),
    ("model", "intermediate_size", 2**21, MLP, "2097152"),
    ("model", "intermediate_size", True, MLP, "True (bool)"),
    ("model", "num_hidden_layers", 10**8, LAYERS, "100000000"),
    ("model", "num_hidden_layers", "1e8", LAYERS, "'1e8' (str)"),
    ("model", "num_hidden_layers", 0, LAYERS, "0"),
    ("model", "num_attention_heads", 0, HEADS, "0"),
    ("model", "num_attention_heads", 8.5, HEADS, "8.5 (float)"),
    ("model", "num_key_value_heads", -2, HEADS, "-2"),
    ("model", "num_key_value_heads", [2], HEADS, "[2]"),
    ("model", "max_position_embeddings", 2**25, POSITIONS, "33554432"),
    ("model", "max_position_embeddings", 0, POSITIONS, "0"),
    ("model", "rope_theta", 0.0, THETA, "0.0"),
    ("model", "rope_theta", -1.0, THETA, "-1.0"),
    ("model", "rope_theta", math.inf, THETA, "inf"),
    ("model", "rope_theta", math.nan, THETA, "nan"),
    ("model", "rope_theta", "1e6", THETA, "'1e6' (str)"),
    ("model", "rms_norm_eps", math.inf, EPS, "inf"),
    ("model", "rms_norm_eps", 0.0, EPS, "0.0"),
    ("model", "rms_norm_eps", 1.0, EPS, "1.0"),
    ("model", "rms_norm_eps", "1e-6", EPS, "'1e-6' (str)"),
    ("model", "tie_word_embeddings", "false", "true or false", "'false' (str)"),
    ("model", "tie_word_embeddings", 0, "true or false", "0"),
    ("model", "tie_word_embeddings", None, "true or false", "None (NoneType)"),
    ("model", "architecture", "llama", "one of qwen2, qwen", "'llama' (str)"),
    ("parallel", "tp", 0, DEGREE, "0"),
    ("parallel", "tp", 2.0, DEGREE, "2.0 (float)"),
    ("parallel", "tp", "8", DEGREE, "'8' (str)"),
    ("parallel", "pp", -1, DEGREE, "-1"),
    ("parallel", "pp", 2**17, DEGREE, "131072"),
    ("parallel", "dp", True, DEGREE, "True (bool)"),
    ("parallel", "dtype", "fp8", "one of float32, bfloat16, float16, float64", "'fp8' (str)"),
    ("parallel", "dtype", 32, "one of float32, bfloat16, float16, float64", "32"),
    ("parallel", "seed", -1, "an integer in [0, 4,611,686,018,427,387,904]", "-1"),
    ("parallel", "seed", 1.5, "an integer in [0, 4,611,686,018,427,387,904]", "1.5 (float)"),
    ("optimizer", "lr", 0, "a finite number in (0, 1]", "0"),
    ("optimizer", "lr", math.inf, "a finite number in (0, 1]", "inf"),
    ("optimizer", "lr", "1e-3", "a finite number in (0, 1]", "'1e-3' (str)"),
    ("optimizer", "lr", 2.0, "a finite number in (0, 1]", "2.0"),
    ("optimizer", "weight_decay", -0.1, "a finite number in [0, 1]", "-0.1"),
    ("optimizer", "weight_decay", math.nan, "a finite number in [0, 1]", "nan"),
    ("optimizer", "betas", [0.9], "two numbers in [0, 1), e.g. [0.9, 0.95]", "[0.9]"),
    ("optimizer", "betas", [0.9, 1.0], "two numbers in [0, 1), e.g. [0.9, 0.95]", "[0.9, 1.0]"),
    ("optimizer", "betas", [True, 0.9], "two numbers in [0, 1), e.g. [0.9, 0.95]", "[True, 0.9]"),
    (
        "optimizer",
        "betas",
        "0.9,0.95",
        "two numbers in [0, 1), e.g. [0.9, 0.95]",
        "'0.9,0.95' (str)",
    ),
]


def _ids(case):
    return f"{case[0]}.{case[1]}={case[2]!r}"


def _message(section, field, allowed, shown):
    return f"{section}.{field} must be {allowed}, got {shown}"


@pytest.mark.parametrize("case", BAD, ids=_ids)
def test_bad_value_in_a_yaml_job_file(case, tmp_path):
    section, field, value, allowed, shown = case
    data = yaml.safe_load(open(MINI))
    data[section][field] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        JobConfig.from_file(str(path))
    if field == "betas" and isinstance(value, list):  # the job file's list becomes a tuple
        shown = repr(tuple(value))
    assert str(e.value) == f"{path}: {_message(section, field, allowed, shown)}"


@pytest.mark.parametrize("case", BAD, ids=_ids)
def test_bad_value_in_direct_construction(case):
    section, field, value, allowed, shown = case
    kind = {"model": Qwen2Config, "parallel": ParallelSettings, "optimizer": OptimizerSettings}
    if field == "betas" and isinstance(value, list):  # the dataclass takes a tuple
        value, shown = tuple(value), repr(tuple(value))
    fields = dict(GOOD[section], **{field: value})
    with pytest.raises(ConfigError) as e:
        kind[section](**fields)
    assert str(e.value) == _message(section, field, allowed, shown)


CROSS = [
    ({"hidden_size": 60}, "model.hidden_size=60 is not divisible by model.num_attention_heads=8"),
    (
        {"hidden_size": 24},
        "model.hidden_size / model.num_attention_heads = 3 (the head size) must be even: rotary "
        "embedding turns pairs of values",
    ),
    (
        {"num_key_value_heads": 3},
        "model.num_attention_heads=8 is not a multiple of model.num_key_value_heads=3",
    ),
    (
        {"architecture": "qwen"},
        "model.architecture 'qwen' (the original Qwen) has no grouped-query attention: "
        "model.num_key_value_heads must equal model.num_attention_heads=8, got 2",
    ),
]


@pytest.mark.parametrize("changes, message", CROSS)
def test_rules_between_fields(changes, message):
    with pytest.raises(ConfigError) as e:
        Qwen2Config(**dict(GOOD["model"], **changes))
    assert str(e.value) == message


def test_sections_and_fields_by_name(tmp_path):
    cases = [
        ({"parallel": [1, 2]}, "parallel must be a mapping of fields, got list"),
        ({"parallel": {"tpp": 2}}, "unknown field parallel.tpp; known fields:"),
        ({"model": None}, "model must be a mapping of fields, got NoneType"),
        ({"trainer": {}}, "unknown field trainer; known fields:"),
    ]
    for changes, message in cases:
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(dict(GOOD, **changes)))
        with pytest.raises(ConfigError) as e:
            JobConfig.from_file(str(path))
        assert str(e.value).startswith(f"{path}: {message}"), str(e.value)
    empty = tmp_path / "empty.yaml"
    empty.write_text(yaml.safe_dump(dict(GOOD, parallel=None, optimizer=None)))
    job = JobConfig.from_file(str(empty))  # an empty section: its defaults, exactly
    assert (job.parallel, job.optimizer) == (ParallelSettings(), OptimizerSettings())


def test_job_sections_must_be_their_classes():
    model = Qwen2Config(**GOOD["model"])
    with pytest.raises(
        ConfigError, match=r"^JobConfig.model must be a Qwen2Config or HFModelSource, got dict$"
    ):
        JobConfig(model=GOOD["model"])
    with pytest.raises(ConfigError, match=r"^JobConfig.parallel must be a ParallelSettings, got"):
        JobConfig(model=model, parallel={"tp": 2})
    assert JobConfig(model=model).optimizer == OptimizerSettings()


def test_large_published_models_pass():
    """Bounds a demanding user does not hit: Llama-3.1-405B's shape, Gemma's vocabulary, a
    10M-token context, and the shipped 72B configs."""
    big = Qwen2Config(
        vocab_size=256_000,
        hidden_size=16_384,
        intermediate_size=53_248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        max_position_embeddings=10_000_000,
        rope_theta=5e5,
        rms_norm_eps=1e-5,
    )
    assert big.head_dim == 128
    for name in ("qwen2-72b.yaml", "qwen-72b.yaml", "qwen2-mini.yaml"):
        JobConfig.from_file(os.path.join(ROOT, "configs", name))


def test_check_tp_of_a_huge_degree_fails_at_once():
    mini = Qwen2Config(**GOOD["model"])
    with pytest.raises(ConfigError, match=r"tp=1000000000 cannot split 8 attention heads"):
        mini.check_tp(10**9)  # listed every size up to 10**9 before: ran for hours
    with pytest.raises(ConfigError, match=r"^tp must be an integer >= 1, got '2' \(str\)$"):
        mini.check_tp("2")


# -- Hugging Face config.json ---------------------------------------------------------------

HF = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 1001,
    "hidden_size": 64,
    "intermediate_size": 44,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}
ROPE = {"rope_theta": 1000000.0, "rope_type": "default"}
NO_THETA = {k: v for k, v in HF.items() if k != "rope_theta"}

HF_GOOD = [
    ("as saved", HF, {}),
    ("rope_parameters", dict(NO_THETA, rope_parameters=ROPE), {}),
    ("rope_parameters per type", dict(NO_THETA, rope_parameters={"full_attention": ROPE}), {}),
    ("rope_scaling null", dict(HF, rope_scaling=None), {}),
    ("kv heads null", dict(HF, num_key_value_heads=None), {"num_key_value_heads": 8}),
    (
        "kv heads absent",
        {k: v for k, v in HF.items() if k != "num_key_value_heads"},
        {"num_key_value_heads": 8},
    ),
    ("tie null", dict(HF, tie_word_embeddings=None), {}),
    ("tie true", dict(HF, tie_word_embeddings=True), {"tie_word_embeddings": True}),
    ("int rope_theta", dict(HF, rope_theta=1000000), {}),
]


@pytest.mark.parametrize("name, data, changes", HF_GOOD, ids=[c[0] for c in HF_GOOD])
def test_hf_config_forms_read_exactly(name, data, changes, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert Qwen2Config.from_file(str(tmp_path)) == Qwen2Config(**dict(GOOD["model"], **changes))


HF_BAD = [
    (dict(HF, num_hidden_layers="2"), f"num_hidden_layers must be {LAYERS}, got '2' (str)"),
    (dict(HF, num_hidden_layers=None), f"num_hidden_layers must be {LAYERS}, got None (NoneType)"),
    (dict(HF, num_hidden_layers=100000000), f"num_hidden_layers must be {LAYERS}, got 100000000"),
    (dict(HF, vocab_size=1001.0), f"vocab_size must be {VOCAB}, got 1001.0 (float)"),
    (dict(HF, num_key_value_heads="2"), f"num_key_value_heads must be {HEADS}, got '2' (str)"),
    (
        dict(HF, tie_word_embeddings="false"),
        "tie_word_embeddings must be true or false, got 'false' (str)",
    ),
    (dict(HF, rms_norm_eps=None), f"rms_norm_eps must be {EPS}, got None (NoneType)"),
    (dict(HF, rope_theta="1e6"), f"rope_theta must be {THETA}, got '1e6' (str)"),
    (NO_THETA, "missing field rope_theta (or rope_parameters.rope_theta)"),
    ({k: v for k, v in HF.items() if k != "hidden_size"}, "missing field hidden_size"),
    (dict(NO_THETA, rope_parameters="x"), "rope_parameters must be a mapping, got 'x'"),
    (
        dict(NO_THETA, rope_parameters=dict(ROPE, rope_type="yarn", factor=4.0)),
        "rope_parameters has rope_type 'yarn'; only plain RoPE (rope_type 'default') is "
        "implemented, so this checkpoint would compute wrong logits",
    ),
    (
        dict(HF, rope_scaling={"type": "linear", "factor": 2.0}),
        "rope_scaling has rope_type 'linear'; only plain RoPE (rope_type 'default') is "
        "implemented, so this checkpoint would compute wrong logits",
    ),
    (
        dict(HF, rope_parameters=dict(ROPE, rope_theta=10000.0)),
        "rope_theta=1000000.0 and rope_parameters.rope_theta=10000.0 disagree; give one",
    ),
    (
        dict(HF, model_type="llama", architectures=["LlamaForCausalLM"]),
        "model_type 'llama' (architectures ['LlamaForCausalLM']) is not a model tp_ext "
        "implements natively; it reads Qwen2/Qwen2.5 ('qwen2') and the original Qwen ('qwen'). "
        "Other transformers architectures go through tp_ext.parallelize(model, 'auto') "
        "(`tp-ext plan --model PATH` counts them)",
    ),
    (
        dict(HF, model_type="qwen2_moe"),
        "model_type 'qwen2_moe' (architectures ['Qwen2ForCausalLM']) is not a model tp_ext "
        "implements natively; it reads Qwen2/Qwen2.5 ('qwen2') and the original Qwen ('qwen'). "
        "Other transformers architectures go through tp_ext.parallelize(model, 'auto') "
        "(`tp-ext plan --model PATH` counts them)",
    ),
    (
        dict(HF, use_sliding_window=True),
        "use_sliding_window is true; this model implements full attention only, so it would "
        "compute wrong logits past the window",
    ),
]

QWEN = {
    "architectures": ["QWenLMHeadModel"],
    "model_type": "qwen",
    "vocab_size": 1001,
    "hidden_size": 64,
    "intermediate_size": 88,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "max_position_embeddings": 256,
    "rotary_emb_base": 10000,
    "layer_norm_epsilon": 1e-6,
}
HF_BAD += [
    (
        dict(QWEN, intermediate_size=87),
        "intermediate_size must be even for the original Qwen (w1 and w2 together), got 87",
    ),
    (dict(QWEN, layer_norm_epsilon=math.inf), f"layer_norm_epsilon must be {EPS}, got inf"),
    (dict(QWEN, rotary_emb_base=0), f"rotary_emb_base must be {THETA}, got 0"),
]


@pytest.mark.parametrize("data, message", HF_BAD, ids=[m[:40] for _, m in HF_BAD])
def test_hf_config_bad_values(data, message, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        Qwen2Config.from_file(str(tmp_path))
    assert str(e.value) == f"{path}: {message}"
    with pytest.raises(ConfigError) as e:  # the job reads a config.json the same way
        JobConfig.from_file(str(path))
    assert str(e.value) == f"{path}: {message}"


def test_original_qwen_config_json_reads_exactly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN))
    config = Qwen2Config.from_file(str(tmp_path))
    assert config == Qwen2Config(
        **dict(
            GOOD["model"],
            architecture="qwen",
            num_key_value_heads=8,
            rope_theta=10000,
            intermediate_size=44,
        )
    )


def test_parallel_section_holds_its_degrees_as_parallel_dims():
    from tp_ext import ParallelDims
    from tp_ext.config import PARALLEL_FIELDS, job_dims
    from tp_ext.dims import MAX_DEGREE, MAX_VIRTUAL_STAGES

    settings = ParallelSettings(tp=2, pp=2, schedule="Interleaved1F1B", virtual_stages=2)
    assert settings.dims == ParallelDims(tp=2, pp=2, dp=None, virtual_stages=2)
    # the bounds of the degrees are ParallelDims' own (one place)
    assert [PARALLEL_FIELDS[k].high for k in ("tp", "pp", "dp")] == [MAX_DEGREE] * 3
    assert PARALLEL_FIELDS["virtual_stages"].high == MAX_VIRTUAL_STAGES
    dims = settings.dims.resolve(8)
    assert settings.describe(dims) == (
        "dims tp=2 x pp=2 x dp=2 on 8 ranks; pipeline schedule Interleaved1F1B, 4 stages "
        "(2 per rank, loop order), 4 micro-batches per step; data parallel ddp over 2 replicas; "
        "activation checkpointing off"
    )
    # a command's job: tp from --tp only (the config's tp is not the job's), named as given
    assert job_dims(settings, {}, 8) == ParallelDims(tp=4, pp=2, dp=1, virtual_stages=2)
    assert job_dims(settings, {"tp": 2}, 8) == ParallelDims(tp=2, pp=2, dp=2, virtual_stages=2)
    with pytest.raises(ValueError) as e:
        job_dims(settings, {"tp": 3}, 8)
    assert str(e.value) == (
        "--tp 3 does not fit the 8 ranks (WORLD_SIZE): tp x pp x dp must equal 8 (with pp=2); "
        "--tp values that work: [1, 2, 4]"
    )
