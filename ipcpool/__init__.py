"""ipcpool: share GPU (or host) memory between processes through a broker daemon."""

from .client import Buffer, Client, Subscription, connect
from .errors import (
    AllocationTooLarge,
    BackendUnavailable,
    BrokerGone,
    ClosedError,
    InvalidRequest,
    IpcPoolError,
    ObjectAborted,
    ObjectExists,
    ObjectNotFound,
    OutOfMemory,
    PeerRefused,
    ProtocolError,
    QuotaExceeded,
    UnknownPool,
    WaitTimeout,
)

__version__ = "0.1.0"

__all__ = [
    "AllocationTooLarge",
    "BackendUnavailable",
    "BrokerGone",
    "Buffer",
    "Client",
    "ClosedError",
    "ObjectAborted",
    "ObjectExists",
    "ObjectNotFound",
    "InvalidRequest",
    "IpcPoolError",
    "OutOfMemory",
    "PeerRefused",
    "ProtocolError",
    "QuotaExceeded",
    "Subscription",
    "UnknownPool",
    "WaitTimeout",
    "connect",
]
