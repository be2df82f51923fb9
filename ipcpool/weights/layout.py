"""Where each tensor of a version lies: shards of at most ``shard_bytes``, tensors at aligned offsets.

A few large shards instead of one allocation per tensor: a version costs a few creates and one
batch attach. On CUDA an allocation above 4 GiB is VMM chunks mapped into one range (a tenth of a
pointer import's cost per byte), and one at most 4 GiB a pool allocation; either way no client is
ever handed a single pool allocation an importer cannot map.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequest, ProtocolError
from ..protocol import CKPT_ITEMSIZE, CKPT_MAX_SHARDS

ALIGN = 256                      # every tensor's offset: enough for any dtype and vector loads
DEFAULT_SHARD_BYTES = 16 << 30   # 8 VMM chunks of 2 GiB on CUDA; a 140 GB model is 9 shards


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str                    # numpy-style name: float32, bfloat16, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        itemsize = CKPT_ITEMSIZE.get(self.dtype)
        if itemsize is None:
            raise InvalidRequest(f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {', '.join(CKPT_ITEMSIZE)}")
        n = itemsize
        for d in self.shape:
            n *= int(d)
        return n


@dataclass(frozen=True)
class Entry:
    """One tensor of a version: where its bytes lie."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int
    offset: int
    nbytes: int

    def wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.shard, self.offset, self.nbytes]

    @classmethod
    def of(cls, e: list) -> Entry:
        if not isinstance(e, list) or len(e) != 6:
            raise ProtocolError("a manifest entry is [name, dtype, shape, shard, offset, nbytes]")
        return cls(e[0], e[1], tuple(e[2]), e[3], e[4], e[5])


def plan(specs: list[TensorSpec], shard_bytes: int = DEFAULT_SHARD_BYTES) -> tuple[list[int], list[Entry]]:
    """The shard sizes and each tensor's entry, in the order given (a file's order keeps reads
    sequential). A tensor larger than ``shard_bytes`` gets a shard of its own."""
    if shard_bytes < ALIGN:
        raise InvalidRequest(f"shard_bytes must be at least {ALIGN}")
    shards: list[int] = []
    entries: list[Entry] = []
    at = 0
    for s in specs:
        n = s.nbytes
        start = -(-at // ALIGN) * ALIGN
        if not shards or (start + n > shard_bytes and at > 0):
            shards.append(0)
            start = 0
        entries.append(Entry(s.name, s.dtype, tuple(int(d) for d in s.shape), len(shards) - 1, start, n))
        at = start + n
        shards[-1] = at
    if len(shards) > CKPT_MAX_SHARDS:
        raise InvalidRequest(f"{len(shards)} shards: at most {CKPT_MAX_SHARDS}; raise shard_bytes")
    return [max(n, 1) for n in shards] or [1], entries
