"""Model weights as checkpoints: lay tensors out in shards, load safetensors files at the
bandwidth, publish versions from live tensors, bind torch modules to a checkpoint's tensors.

    header    a safetensors file's header: its tensors and where their bytes lie
    sources   the tensors of a file or a sharded directory
    layout    shards and each tensor's ``Entry`` in them
    load      a version loaded from files, and the elected loader (``load_or_attach``)
    modules   torch: a version from live tensors; a module's weights bound to a checkpoint

The client's facade calls in here (``Client.load_checkpoint`` and the like) passing itself, so
nothing here imports the client: the package stands below it.
"""

from .layout import ALIGN, DEFAULT_SHARD_BYTES, TensorSpec, plan
from .load import load_checkpoint, load_or_attach
from .sources import SourceTensor, read_source

__all__ = ["ALIGN", "DEFAULT_SHARD_BYTES", "SourceTensor", "TensorSpec", "load_checkpoint", "load_or_attach",
           "plan", "read_source"]
