"""``ipcpool serve-peer``: a client of the local broker that lets peers read checkpoint versions
through NIXL.

A separate process, not the broker: NIXL and UCX (threads, a listener, network ports, a few
hundred MB of libraries) stay out of the process that owns every client's memory, and a fault in
them costs a pull, never the node's broker. It attaches a version zero-copy (a reader like any
other: the version stays alive while served), registers its shards with its NIXL agent (or copies
of them in buffers NIXL takes: ``staging``) and answers a peer's request with the
manifest and a digest per tensor; the peer then reads the bytes itself (one-sided NIXL READs)
and says when it is done. A request that fails is answered with the reason, never fatal.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import Fleet
from ..errors import IpcPoolError, ProtocolError, TransferFailed
from ..weights.layout import Entry
from . import nixl, staging, wire
from .digests import digests

log = logging.getLogger(__name__)

PULLER = "#pull-"        # a puller's agent is "<its node's name>#pull-<pid>-<n>"
REPLY_WINDOW = 10.0      # seconds a reply may wait for the puller's metadata to arrive
# Test hook: a byte of this tensor is flipped in the served memory once its digest is taken,
# as a fault between two brokers would; the puller must refuse the version.
FLIP_ENV = "IPCPOOL_TEST_FLIP_BYTE"


@dataclass
class Served:
    """A version attached and registered with NIXL, and the pulls of it under way."""
    name: str
    version: int
    shards: list[Any]
    entries: list[Entry]
    user: dict
    registered: staging.Registered
    digests: list[bytes]
    pulls: set[str] = field(default_factory=set)


class PeerServer:
    """Serves the checkpoints ``fleet.serve`` names to the agents ``fleet.peers`` names."""

    def __init__(self, client: Any, fleet: Fleet):
        self.client = client
        self.fleet = fleet
        self.on_gpu = client.parts.backend.on_gpu
        self.memory = nixl.memory_type(self.on_gpu)
        self.staging = staging.setting(fleet)
        self.agent = nixl.agent(fleet.agent, fleet.port, self.on_gpu)
        self.served: dict[str, dict[int, Served]] = {}   # name -> version -> what is served
        self.replies: list[tuple[float, str, bytes]] = []  # waiting for the puller's metadata
        self.stop = threading.Event()
        self.flip = os.environ.get(FLIP_ENV)

    def serve_forever(self, poll: float = 0.002) -> None:
        log.info("serving checkpoints %s to peers %s as NIXL agent %r, listener on port %d (%s memory, "
                 "staging %s: %s)", list(self.fleet.serve) or "(none: [nixl] serve is empty)",
                 sorted(self.fleet.peers) or "(none)", self.fleet.agent, self.fleet.port, self.memory, self.staging,
                 " then ".join(staging.attempts(self.staging, self.on_gpu)))
        while not self.stop.is_set():
            busy = self.step()
            if not busy:
                time.sleep(poll)

    def step(self) -> bool:
        """Answer what came in; True when there was something."""
        got = self.agent.get_new_notifs()
        for peer, messages in got.items():
            for raw in messages:
                self._handle(peer, raw)
        self._send_replies()
        return bool(got)

    def close(self) -> None:
        for s in [s for versions in self.served.values() for s in versions.values()]:
            self._drop(s)

    # -- requests ------------------------------------------------------------------------------
    def _handle(self, peer: str, raw: bytes) -> None:
        try:
            msg = wire.decode(raw)
        except ProtocolError as exc:
            log.warning("peer agent %r: %s", peer, exc)
            return
        if msg is None:
            return
        req = msg["req"]
        try:
            node = peer.rpartition(PULLER)[0]
            if node not in self.fleet.peers:
                raise IpcPoolError(f"agent {peer!r} is not of a node named under [peers] of {self.fleet.agent!r}")
            if msg["op"] == "want":
                reply = self._want(req, msg)
            elif msg["op"] == "done":
                self._done(req, msg)
                return
            else:
                raise ProtocolError(f"unknown op {msg['op']!r}")
        except IpcPoolError as exc:   # refused, or failed (NIXL's refusals come as TransferFailed)
            log.log(logging.WARNING if isinstance(exc, TransferFailed) else logging.INFO,
                    "peer agent %r, request %s: %s", peer, req, exc)
            reply = wire.encode("error", req=req, error=str(exc))
        except Exception as exc:   # anything else fails this request, never the serve-peer
            log.exception("peer agent %r, request %s failed", peer, req)
            reply = wire.encode("error", req=req, error=f"{type(exc).__name__}: {exc}")
        self.replies.append((time.monotonic() + REPLY_WINDOW, peer, reply))

    def _want(self, req: str, msg: dict) -> bytes:
        name, version = msg.get("name"), msg.get("version")
        if not isinstance(name, str) or not (version is None or isinstance(version, int)):
            raise ProtocolError("want: name (str) and version (int or nil)")
        if not self.fleet.serves(name):
            raise IpcPoolError(f"checkpoint {name!r} is not served to peers (the [nixl] serve prefixes of "
                               f"{self.fleet.agent!r}: {list(self.fleet.serve)})")
        s = self._serve(name, version)
        s.pulls.add(req)
        log.info("request %s: %s@%d to %s", req, name, s.version, msg.get("node", "?"))
        return wire.encode("manifest", req=req, name=name, version=s.version, memory=s.registered.memory,
                           shards=[list(r) for r in s.registered.regions],
                           entries=[e.wire() for e in s.entries], digests=s.digests, user=s.user,
                           staged=s.registered.staged, through=s.registered.through,
                           refused=bool(s.registered.refused))

    def _serve(self, name: str, version: int | None) -> Served:
        versions = self.served.setdefault(name, {})
        if version is not None and version in versions:
            return versions[version]
        number, shards, entries, user = self.client.parts.checkpoints.attach(name, version, "numpy", None)
        if number in versions:   # the current one, served already
            for b in shards:
                b.free()
            return versions[number]
        try:
            sums = digests(shards, entries)
            if self.flip is not None:
                _flip_byte(shards, entries, self.flip)
            registered = staging.register(self.agent, shards, self.client.parts.backend, f"{name}@{number}", fill=True,
                                          asked=self.staging)
        except BaseException:
            for b in shards:
                b.free()
            raise
        s = versions[number] = Served(name, number, shards, entries, user, registered, sums)
        for old in [v for v in versions.values() if v.version < number and not v.pulls]:
            self._drop(old)   # replaced, and no pull of it under way
        return s

    def _done(self, req: str, msg: dict) -> None:
        versions = self.served.get(msg.get("name"), {})
        s = versions.get(msg.get("version"))
        if s is None:
            return
        s.pulls.discard(req)
        if not s.pulls and s.version < max(versions):
            self._drop(s)

    def _drop(self, s: Served) -> None:
        """Deregistered first (a peer's read now fails rather than reads reused memory), then let go."""
        s.registered.close()
        for b in s.shards:
            b.free()
        self.served.get(s.name, {}).pop(s.version, None)

    def _send_replies(self) -> None:
        """A reply goes once the puller's metadata (sent before its request) has arrived."""
        waiting = []
        for deadline, peer, reply in self.replies:
            try:
                self.agent.send_notif(peer, reply)
            except Exception as exc:   # NIXL's not-found error: its metadata is not here yet
                if time.monotonic() < deadline:
                    waiting.append((deadline, peer, reply))
                else:
                    log.warning("no reply to agent %r: its metadata never arrived (%s)", peer, exc)
        self.replies = waiting


def _flip_byte(shards: list[Any], entries: list[Entry], tensor: str) -> None:
    for e in entries:
        if e.name == tensor and e.nbytes:
            shard = shards[e.shard]
            view = shard.memory.view
            if view is not None:
                view[e.offset] ^= 0xFF
            else:
                from .._client.views import raw_view

                raw_view(shard, "torch", False)[e.offset].bitwise_xor_(0xFF)
            log.warning("test hook %s: flipped the first byte of %r in the served copy", FLIP_ENV, tensor)
