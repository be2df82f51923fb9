"""ipcpool: share GPU (or host) memory between processes through a broker daemon."""

from ._version import __version__  # noqa: F401 (public, outside __all__ as is usual)
from ._client.catalog import Subscription
from ._client.checkpoints import Checkpoint, VersionWriter
from ._client.client import Client, connect
from ._client.leases import Buffer
from .errors import (
    AllocationTooLarge,
    BackendUnavailable,
    BrokerBusy,
    BrokerGone,
    ClosedError,
    DigestMismatch,
    InvalidRequest,
    IpcPoolError,
    MissingDependency,
    ObjectAborted,
    ObjectExists,
    ObjectNotFound,
    OutOfMemory,
    PeerRefused,
    ProtocolError,
    QuotaExceeded,
    TransferFailed,
    UnknownPool,
    WaitTimeout,
)

__all__ = [
    "AllocationTooLarge",
    "BackendUnavailable",
    "BrokerBusy",
    "BrokerGone",
    "Buffer",
    "Checkpoint",
    "Client",
    "ClosedError",
    "DigestMismatch",
    "ObjectAborted",
    "ObjectExists",
    "ObjectNotFound",
    "InvalidRequest",
    "IpcPoolError",
    "MissingDependency",
    "OutOfMemory",
    "PeerRefused",
    "ProtocolError",
    "QuotaExceeded",
    "Subscription",
    "TransferFailed",
    "UnknownPool",
    "VersionWriter",
    "WaitTimeout",
    "connect",
]
