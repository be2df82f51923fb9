"""The broker's tables, made once at start and shared by the parts that serve requests (handlers,
sessions, control): one object to pass instead of five, so a new table is added in one place."""

from __future__ import annotations

from dataclasses import dataclass

from .directory import Directories
from .checkpoints import CheckpointTable
from .durable import Durability
from .growables import GrowableTable
from .handoff import Handoffs
from .objects import ObjectTable
from .registry import Registry


@dataclass(frozen=True, slots=True)
class Tables:
    registry: Registry       # pools, their generations and quotas
    objects: ObjectTable     # named objects and their leases
    growables: GrowableTable
    handoffs: Handoffs       # seal boards and subscriptions
    durable: Durability      # what outlives the broker (FD store, records)
    directories: Directories   # name directories and lease pages (reads without a reply)
    checkpoints: CheckpointTable   # named sets of tensors in versions (not durable yet)
