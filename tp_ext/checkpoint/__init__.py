"""Checkpoints of tp_ext models: read and written per rank, never unpickled, atomic.

- :mod:`.hf`: Hugging Face safetensors in (each rank reads its own slices) and merged out;
- :mod:`.dcp`: sharded training checkpoints through torch.distributed.checkpoint, resharding
  between any two TP degrees;
- :mod:`.checkpoint_map`: how a model declares where its tensors live in a checkpoint (the
  checkpoint code never imports a model);
- :mod:`.safetensors_io`, :mod:`.atomic`, :mod:`.memory`: slice reads, atomic directories with
  manifests, host-memory measurement for load reports.
"""

from tp_ext.checkpoint.atomic import complete_checkpoint
from tp_ext.checkpoint.checkpoint_map import Piece
from tp_ext.checkpoint.dcp import load_sharded, save_sharded
from tp_ext.checkpoint.errors import CheckpointError
from tp_ext.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
from tp_ext.checkpoint.manifest import MANIFEST
from tp_ext.checkpoint.memory import (
    current_rss_bytes,
    import_readers,
    peak_rss_bytes,
    reset_peak_rss,
)
from tp_ext.checkpoint.safetensors_io import READ_CHUNK_BYTES, checkpoint_dtype

__all__ = [
    "CheckpointError",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "save_sharded",
    "load_sharded",
    "complete_checkpoint",
    "checkpoint_dtype",
    "peak_rss_bytes",
    "reset_peak_rss",
    "current_rss_bytes",
    "import_readers",
    "Piece",
    "MANIFEST",
    "READ_CHUNK_BYTES",
]
