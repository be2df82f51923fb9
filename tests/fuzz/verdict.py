"""How the fuzz judges the broker's replies: none undecodable, no internal error, no ``ok`` to a
request malformed by construction; and the summary of a run."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipcpool import protocol
from ipcpool.errors import InternalError, IpcPoolError

INTERNAL = "internal broker error"   # how a broker bug's reply begins (older brokers: code 1)


def is_internal(reply: dict) -> bool:
    """A reply that reports a broker bug rather than a refusal of the request."""
    return reply.get("code") == InternalError.code or INTERNAL in str(reply.get("error", ""))


@dataclass
class Summary:
    seed: int
    zmq_frames: int = 0
    zmq_replies: int = 0
    control_frames: int = 0
    control_replies: int = 0
    batches: int = 0
    alive_checks: int = 0
    by_kind: dict = field(default_factory=dict)
    ok_to_valid: int = 0
    error_replies: int = 0
    internal_errors: list = field(default_factory=list)
    ok_to_malformed: list = field(default_factory=list)
    undecodable: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> int:
        return len(self.internal_errors) + len(self.ok_to_malformed) + len(self.undecodable)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        for k in ("internal_errors", "ok_to_malformed", "undecodable"):
            d[k] = len(d[k])
            d[f"{k}_examples"] = [repr(x)[:300] for x in getattr(self, k)[:5]]
        return d


class BrokerDown(AssertionError):
    """The broker stopped serving during the run."""


class Checker:
    def __init__(self, summary: Summary):
        self.s = summary
        self.malformed: dict[int, str] = {}   # request id -> kind, for requests malformed by construction
        self.valid_id0 = 0                     # frames the validator accepts with id 0 (in this batch)

    def reply(self, data: bytes, where: str) -> dict | None:
        try:
            reply = protocol.unpack(data, protocol.MAX_REPLY)
        except IpcPoolError as exc:
            self.s.undecodable.append((where, str(exc)[:200], data[:100]))
            return None
        if "notify" in reply:
            return reply
        if reply.get("ok"):
            rid = reply.get("id")
            kind = self.malformed.get(rid) if rid != 0 else (None if self.valid_id0 else "id 0")
            if kind is not None:
                self.s.ok_to_malformed.append((where, kind, rid))
            else:
                self.s.ok_to_valid += 1
        else:
            self.s.error_replies += 1
            if is_internal(reply):
                self.s.internal_errors.append((where, reply.get("error")))
        return reply
