"""Hugging Face decoders as tp_ext sees them without building them: their config read from a
config.json or a checkpoint directory (:mod:`.config`), and what each rank holds once
``parallelize(model, "auto")`` converts them, counted on the meta device (:mod:`.shards`)."""

from tp_ext.models.hf.config import hf_config_from_dict, is_hf_config_dict, load_hf_config
from tp_ext.models.hf.shards import HFModelShards, meta_model, model_shards, narrow_config

__all__ = [
    "load_hf_config",
    "hf_config_from_dict",
    "is_hf_config_dict",
    "HFModelShards",
    "model_shards",
    "meta_model",
    "narrow_config",
]
