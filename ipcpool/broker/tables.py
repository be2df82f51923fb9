"""The broker's tables, made once at start and shared by the parts that serve requests (handlers,
sessions, control): one object to pass instead of five, so a new table is added in one place."""

from __future__ import annotations

from dataclasses import dataclass

from .arenas import Handoffs
from .checkpoints import CheckpointTable
from .directory import Directories
from .durable import Durability
from .growables import GrowableTable
from .objects import ObjectTable
from .registry import Registry


@dataclass(frozen=True, slots=True)
class Tables:
    registry: Registry       # pools, their generations and quotas
    objects: ObjectTable     # named objects and their leases
    growables: GrowableTable
    handoffs: Handoffs       # client arenas mirrored, and their seal-board blocks
    durable: Durability      # what outlives the broker (FD store, records)
    directories: Directories   # name directories and lease pages (reads without a reply)
    checkpoints: CheckpointTable   # named sets of tensors in versions (not durable yet)
