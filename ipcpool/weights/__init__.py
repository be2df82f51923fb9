"""Model weights as checkpoints: lay tensors out in shards, load safetensors files at the
bandwidth, publish versions from live tensors, bind torch modules to a checkpoint's tensors."""

from .layout import ALIGN, DEFAULT_SHARD_BYTES, TensorSpec, plan
from .load import load_checkpoint, load_or_attach
from .sources import SourceTensor, read_source

__all__ = ["ALIGN", "DEFAULT_SHARD_BYTES", "SourceTensor", "TensorSpec", "load_checkpoint", "load_or_attach",
           "plan", "read_source"]
