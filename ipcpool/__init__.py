"""ipcpool: share GPU (or host) memory between processes through a broker daemon."""

from .client import Buffer, Client, connect
from .errors import (
    AllocationTooLarge,
    BackendUnavailable,
    BrokerGone,
    ClosedError,
    InvalidRequest,
    IpcPoolError,
    OutOfMemory,
    PeerRefused,
    ProtocolError,
    QuotaExceeded,
    UnknownPool,
)

__version__ = "0.1.0"

__all__ = [
    "AllocationTooLarge",
    "BackendUnavailable",
    "BrokerGone",
    "Buffer",
    "Client",
    "ClosedError",
    "InvalidRequest",
    "IpcPoolError",
    "OutOfMemory",
    "PeerRefused",
    "ProtocolError",
    "QuotaExceeded",
    "UnknownPool",
    "connect",
]
