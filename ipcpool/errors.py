"""One error root with meaningful subclasses, each with a stable wire code.

Codes are registered by ``__init_subclass__`` so the broker can send ``code`` and the client can
raise the same class on its side without an if/elif chain.
"""

from __future__ import annotations

_BY_CODE: dict[int, type[IpcPoolError]] = {}


class IpcPoolError(Exception):
    """Root of every error ipcpool raises."""

    code = 1

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            if cls.code in _BY_CODE:
                raise TypeError(f"wire code {cls.code} used twice ({_BY_CODE[cls.code].__name__})")
            _BY_CODE[cls.code] = cls


_BY_CODE[IpcPoolError.code] = IpcPoolError


class ClosedError(IpcPoolError):
    """Used after you closed it (the client, a buffer)."""

    code = 2


class BrokerGone(IpcPoolError, ConnectionError):
    """The broker is not running, or went away mid-session. Also a ConnectionError, so code that
    handles a lost connection handles this one."""

    code = 3


class PeerRefused(IpcPoolError):
    """The broker refused this process (uid/gid not allowed, or a bad session token)."""

    code = 4


class QuotaExceeded(IpcPoolError):
    """The request would take the caller's uid over its quota."""

    code = 5


class OutOfMemory(IpcPoolError):
    """The pool cannot hold the request."""

    code = 6


class UnknownPool(IpcPoolError):
    """No pool of that name is configured."""

    code = 7


class ProtocolError(IpcPoolError):
    """A malformed, oversized or out-of-version message."""

    code = 8


class BackendUnavailable(IpcPoolError):
    """The requested memory backend cannot run here (no driver, no device, missing feature)."""

    code = 9


class InvalidRequest(IpcPoolError, ValueError):
    """A well-formed request with a bad argument (size, unknown allocation, ...). Also a
    ValueError: a bad argument is one, wherever it is found."""

    code = 10


class AllocationTooLarge(InvalidRequest):
    """A growable buffer asked for above the largest size one may have (``MAX_GROWABLE``)."""

    code = 11


class ObjectExists(InvalidRequest):
    """A named object of that name already exists."""

    code = 12


class ObjectNotFound(InvalidRequest, LookupError):
    """No sealed object of that name (and the caller chose not to wait). Also a LookupError, as
    a missing key is."""

    code = 13


class ObjectAborted(IpcPoolError):
    """The object's writer went away, deleted it or gave it up before sealing it."""

    code = 14

    @classmethod
    def of(cls, name: str) -> ObjectAborted:
        """What a reader of ``name`` is told, by the broker or its own directory."""
        return cls(f"object {name!r} was abandoned before it was sealed (its writer went away, deleted it or gave it up)")


class WaitTimeout(IpcPoolError, TimeoutError):
    """What was waited for did not happen within the timeout. Also a TimeoutError."""

    code = 15


class InternalError(IpcPoolError):
    """A bug in the broker: handling the request raised what no check foresaw. The broker logged
    the traceback and serves on; report the message with that log."""

    code = 16

    @classmethod
    def of(cls, exc: BaseException) -> InternalError:
        """The error a client is told of for ``exc``, an unexpected exception in the broker."""
        return cls(f"internal broker error (a broker bug; the broker's log has the traceback): {exc}")


class ConfigError(IpcPoolError):
    """The configuration file is unreadable or holds a bad value."""

    code = 20


class AlreadyRunning(IpcPoolError):
    """Another broker serves this socket directory."""

    code = 21


class BrokerBusy(IpcPoolError):
    """The broker refused a new session for now: it is near its limit of open files. Retry later,
    or ask the operator to raise the service's LimitNOFILE."""

    code = 24


class MissingDependency(IpcPoolError, ModuleNotFoundError):
    """An optional library (torch, CuPy) this call needs is not installed; the message says which
    extra to install, or what to use instead. Raised on the client; its code is never sent."""

    code = 30


class DemoFailed(IpcPoolError):
    """``ipcpool demo`` could not run to the end; the message says which step failed and why.
    Raised by the command; its code is never sent."""

    code = 31


class TransferFailed(IpcPoolError):
    """A pull from a peer node did not complete: the peer did not answer, refused, or NIXL/UCX
    failed. Nothing was published; the message says which step and why. Raised on the client."""

    code = 32


class DigestMismatch(TransferFailed):
    """A pulled tensor's bytes differ from the digest its peer computed: the message names the
    tensor. Nothing was published. Raised on the client."""

    code = 33


def error_from_wire(code: int, message: str) -> IpcPoolError:
    """Rebuild the error the broker reported; unknown codes fall back to the root class."""
    cls = _BY_CODE.get(code, IpcPoolError) if isinstance(code, int) else IpcPoolError
    return cls(message)
