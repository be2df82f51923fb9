"""Pull a checkpoint version from a peer node's broker through NIXL.

The new local version is begun unpublished, the same shard for shard and offset for offset as
the peer's; NIXL READs every byte straight into it (or into buffers NIXL takes, then copied into
it: ``staging``, on CUDA through GPU buffers by default); each tensor's digest is checked against the peer's;
only then is it published. Any failure (the peer, the network, a digest, this process killed)
leaves no version behind: an unpublished version dies with its writer, as a load's does.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import cpus
from ..config import Config, Fleet, load
from ..errors import DigestMismatch, InvalidRequest, IpcPoolError, TransferFailed
from ..progress import Progress
from ..sizes import format_size
from ..weights.layout import Entry
from . import nixl, staging, transport, wire
from .digests import digests
from .serve import PULLER

log = logging.getLogger(__name__)

# UCX sets a peer's memory up at an agent's first read of it (it picks the protocol then, for one):
# on an H100 the floor's first 1 GiB READ took 5.9 ms, the next 0.8. These first bytes of each
# region are read before the clock starts, so that ``seconds`` is the bytes moving, as the floor
# of bench/pull.py times them.
WARM = 4096
SPIN_US = 20_000    # a read polled without pause this long where spinning pays, then every PAUSE s
PAUSE = 0.0005
# Test hook: a slow link. Requests of STALL_PIECE bytes, one at a time, this many seconds apart.
STALL_ENV = "IPCPOOL_TEST_PULL_STALL"
STALL_PIECE = 1 << 20
Descs = list[tuple[int, int, int]]   # NIXL descriptors: (address, size, device)
Read = tuple[Descs, Descs]            # one xfer: local, remote
SYSTEM_CONFIG = Path("/etc/ipcpool/broker.toml")   # where the system service's unit reads it
_agents = 0


@dataclass(frozen=True)
class PullResult:
    name: str                 # the local checkpoint
    version: int              # its new local version
    peer: str
    peer_version: int
    nbytes: int
    tensors: int
    seconds: float            # NIXL moving the bytes: the READ's start to its end (made and set up before)
    total_seconds: float      # the whole pull: metadata, manifest, transfer, digests, publish
    transport: transport.Transport
    memory: str               # the local memory: DRAM or VRAM
    staged: str = ""          # whose memory went through buffers, and which, in words ("": none)
    staging: tuple[str, str] = ("", "")   # (the peer's, this node's): "" (registered as it is), "gpu", "host"
    host_staged: str = ""     # the sides staged through host buffers, and why, in words (the warning)

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def warning(self) -> str | None:
        said = []
        if self.host_staged:
            said.append(f"{self.host_staged}, so every byte was copied once more on each side so staged and UCX "
                        "moved host memory, with no GPU transport (see docs/fleet.md)")
        if self.transport.tcp_gpu:
            said.append("GPU memory went over TCP: UCX found no GPU transport (RDMA with GPUDirect, cuda_ipc) "
                        "between these peers, so the bytes were staged through host memory and sockets, far "
                        "below what the GPUs and the network can do (see docs/fleet.md)")
        return "; ".join(said) or None

    def summary(self) -> str:
        return (f"pulled {self.peer}'s {self.name}@{self.peer_version} as version {self.version}: {self.tensors} "
                f"tensor(s), {format_size(self.nbytes)} in {self.seconds:.3f} s "
                f"({format_size(self.bytes_per_s)}/s; {self.total_seconds:.3f} s in all) over "
                f"{self.transport.describe()}" + (f"; {self.staged}" if self.staged else ""))


def fleet_of(config: Config | Fleet | str | os.PathLike | None) -> Fleet:
    """[nixl] and [peers] of a Config, or of a file (None: $IPCPOOL_CONFIG, else the system
    service's /etc/ipcpool/broker.toml where it exists, else nothing configured)."""
    if isinstance(config, Fleet):
        return config
    if isinstance(config, Config):
        return config.fleet
    config = config or os.environ.get("IPCPOOL_CONFIG") or (str(SYSTEM_CONFIG) if SYSTEM_CONFIG.exists() else None)
    return load(config).fleet


def pull(client: Any, peer: str, name: str, *, version: int | None = None, config: Any = None,
         local_name: str | None = None, pool: str = "default", timeout: float = 60.0,
         progress: bool = False) -> PullResult:
    """Pull ``name`` (its current version, or ``version``) from ``peer`` (a name under [peers]
    of ``config``: see ``fleet_of``) into a new, published version of ``local_name`` (default:
    the same name) of ``client``'s broker. Raises TransferFailed (DigestMismatch for bad bytes)
    having published nothing."""
    fleet = fleet_of(config)
    if peer not in fleet.peers:
        known = ", ".join(sorted(fleet.peers)) or "none: add a [peers] table to broker.toml"
        raise InvalidRequest(f"no peer named {peer!r} in the configuration (peers: {known})")
    host, port = fleet.peers[peer]
    asked = staging.setting(fleet)
    t0 = time.monotonic()
    mark = transport.mark()   # UCX writes its tables as it connects, before the first read
    global _agents
    _agents += 1
    with transport.capturing():
        agent = nixl.agent(f"{fleet.agent}{PULLER}{os.getpid()}-{_agents}", 0, client.parts.backend.on_gpu)
    session = _Session(agent, peer, host, port, timeout)
    try:
        session.connect()
        req = secrets.token_hex(8)
        manifest = session.ask(req, name, version, fleet.agent)
        try:
            return _fill(client, session, manifest, local_name or name, pool, progress, t0, mark, asked)
        finally:
            session.tell(wire.encode("done", req=req, name=name, version=manifest["version"]))
    finally:
        session.close()


def _fill(client: Any, session: _Session, manifest: dict, local_name: str, pool: str, progress: bool, t0: float,
          mark: int, asked: str) -> PullResult:
    entries = [Entry.of(e) for e in manifest["entries"]]
    remote = [tuple(s) for s in manifest["shards"]]
    sums = list(manifest["digests"])
    if len(sums) != len(entries):
        raise TransferFailed(f"peer {session.peer}: {len(sums)} digests for {len(entries)} tensors")
    peer_version = manifest["version"]
    user = {**dict(manifest.get("user") or {}), "pulled_from": session.peer, "peer_version": peer_version}
    memory = nixl.memory_type(client.parts.backend.on_gpu)
    total = sum(s[1] for s in remote)   # what NIXL moves: the shards, alignment gaps included
    with client.new_version_like(local_name, [s[1] for s in remote], entries, pool=pool, user=user) as w:
        try:
            local = staging.register(session.agent, w.shards, client.parts.backend,
                                     f"the new version of {local_name} here", fill=False, asked=asked)
        except TransferFailed as exc:
            raise TransferFailed(f"{exc}; nothing was published") from exc
        try:   # deregistered before the shards are handed to the broker, whatever happens
            first, reads = _reads(local.regions, remote, STALL_PIECE if os.environ.get(STALL_ENV) else None)
            session.await_memory(remote, manifest["memory"])
            with _bar(f"pulling {manifest['name']}@{peer_version} from {session.peer}", total, progress) as bar:
                seconds = session.read(first, reads, local.memory, manifest["memory"], bar)
            local.from_staged()   # staged: the bytes into the shards (checked below, from there)
        finally:
            local.close()
        for e, got, want in zip(entries, digests(w.shards, entries), sums):   # every byte arrived: check them
            if got != want:
                raise DigestMismatch(f"tensor {e.name!r} of {manifest['name']}@{peer_version} pulled from "
                                     f"{session.peer}: its bytes differ from the peer's digest (corrupted on "
                                     f"the way or at the source); nothing was published")
        number = w.publish()
    # (a serve-peer that predates GPU buffers staged through host buffers only)
    theirs = (manifest.get("staged"), manifest.get("through") or "host", bool(manifest.get("refused", True)))
    ours = (local.staged, local.through, bool(local.refused))
    host = _staged(session.peer, theirs, ours, only="host")
    if host:
        host += (": NIXL refused to register that memory (for GPU memory: UCX without CUDA support, most likely)"
                 if theirs[2] or ours[2] else f": as [nixl] staging (or {staging.STAGING_ENV}) asks")
    return PullResult(local_name, number, session.peer, peer_version, total, len(entries), seconds,
                      time.monotonic() - t0, transport.since(mark), memory, _staged(session.peer, theirs, ours),
                      (theirs[1] if theirs[0] else "", ours[1] if ours[0] else ""), host)


def _staged(peer: str, theirs: tuple, ours: tuple, only: str | None = None) -> str:
    """Which side's memory went through which buffers, in words: a side is (its memory type or
    None where not staged, "gpu" or "host", ...); ``only``: the sides staged through those."""
    through: dict[str, list[str]] = {}
    for who, (memory, kind, *_) in ((f"{peer}'s", theirs), ("this node's", ours)):
        if memory and only in (None, kind):
            through.setdefault(kind, []).append(f"{who} {staging.KINDS.get(str(memory), 'memory')}")
    return " and ".join(f"{' and '.join(sides)} staged through {staging.THROUGH[kind]}"
                        for kind, sides in through.items())


def _bar(label: str, total: int, on: bool) -> Any:
    return Progress(label, total, unit="B") if on else nullcontext(None)


def _reads(local: Descs, remote: Descs, step: int | None = None) -> tuple[Read, list[Read]]:
    """(the first read, the reads), each a NIXL xfer of (local, remote) descriptors. The first:
    WARM bytes of each region (UCX's set-up). The reads: one of every byte, a descriptor per
    region (each is a registration of its own, which a descriptor may not cross); with ``step``
    (the stall hook), one per ``step`` bytes."""
    for (_, mine_size, _), (_, size, _) in zip(local, remote):
        if mine_size != size:
            raise TransferFailed(f"a local shard of {mine_size} bytes for a peer's of {size}")
    first = ([(p, min(n, WARM), d) for p, n, d in local], [(a, min(n, WARM), d) for a, n, d in remote])
    if step is None:
        return first, [(list(local), list(remote))]
    return first, [([(p + at, min(step, n - at), d)], [(a + at, min(step, n - at), rd)])
                   for (p, n, d), (a, _, rd) in zip(local, remote) for at in range(0, n, step)]


class _Session:
    """One puller agent talking to one peer's serve-peer: metadata, the manifest, the reads."""

    def __init__(self, agent: Any, peer: str, host: str, port: int, timeout: float):
        self.agent, self.peer, self.host, self.port, self.timeout = agent, peer, host, port, timeout
        self.spin = cpus.spin_default(SPIN_US) / 1e6

    def _fail(self, what: str, ours: bool = True) -> TransferFailed:
        """A failure at ``peer``, with where this process's UCX logged (``ours``: not for an error
        the peer answered, which its own log tells)."""
        where = transport.log_path() if ours else None
        return TransferFailed(f"peer {self.peer} ({self.host}:{self.port}): {what}"
                              + (f" (UCX's log: {where})" if where else ""))

    def _wait(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while not done():
            if time.monotonic() > deadline:
                raise self._fail(f"{what} within {self.timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def connect(self) -> None:
        """Our metadata to the peer's listener (it answers through it), and its metadata to us;
        asked again every second (a refused connection is not retried by NIXL)."""
        asked = [0.0]

        def arrived() -> bool:
            if time.monotonic() - asked[0] >= 1.0:
                asked[0] = time.monotonic()
                self.agent.send_local_metadata(self.host, self.port)
                self.agent.fetch_remote_metadata(self.peer, self.host, self.port)
            return self.agent.check_remote_metadata(self.peer)

        self._wait(arrived, "no NIXL metadata came back (is `ipcpool serve-peer` running there, its [nixl] "
                            f"name {self.peer!r} and its port reachable?)")

    def ask(self, req: str, name: str, version: int | None, node: str) -> dict:
        self.tell(wire.encode("want", req=req, name=name, version=version, node=node))
        got: list[dict] = []

        def answered() -> bool:
            for raw in self.agent.get_new_notifs().get(self.peer, []):
                try:
                    msg = wire.decode(raw)
                except IpcPoolError:
                    continue
                if msg is not None and msg.get("req") == req:
                    got.append(msg)
            return bool(got)

        self._wait(answered, f"no answer to the request for {name!r}")
        msg = got[0]
        if msg["op"] == "error":   # refused, or failed there: the serve-peer lives on and says why
            raise self._fail(str(msg.get("error")), ours=False)
        if msg["op"] != "manifest":
            raise self._fail(f"an answer of op {msg['op']!r}")
        return msg

    def tell(self, raw: bytes) -> None:
        try:
            self.agent.send_notif(self.peer, raw)
        except Exception as exc:   # NIXL's own error classes: translated at the boundary
            raise self._fail(f"NIXL could not send to it: {exc}") from exc

    def await_memory(self, theirs: list[tuple[int, int, int]], memory: str) -> None:
        """The peer registered the version's memory after we first fetched its metadata: fetch
        it again until it covers what we are about to read."""
        if not theirs:
            return
        descs = self.agent.get_xfer_descs(theirs, memory)
        self.agent.fetch_remote_metadata(self.peer, self.host, self.port)
        self._wait(lambda: self.agent.check_remote_metadata(self.peer, descs),
                   "its metadata never covered the checkpoint's memory")

    def read(self, first: Read, reads: list[Read], memory: str, remote_memory: str, bar: Any) -> float:
        """NIXL READs: ``first`` (off the clock), then ``reads`` one after another, ``bar``
        advanced as each ends; the seconds from each one's start to its end, summed. Every xfer
        is made before the first starts."""
        stall = float(os.environ.get(STALL_ENV) or 0)
        handles: list[Any] = []
        try:
            for mine, theirs in [first, *reads]:
                handles.append(self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(mine, memory),
                                                          self.agent.get_xfer_descs(theirs, remote_memory), self.peer))
            self._run(handles[0])
            seconds = 0.0
            for handle, (mine, _) in zip(handles[1:], reads):
                t0 = time.perf_counter()
                self._run(handle)
                seconds += time.perf_counter() - t0
                if bar is not None:
                    bar.update(sum(d[1] for d in mine))
                if stall:
                    time.sleep(stall)
            return seconds
        except IpcPoolError:
            raise
        except Exception as exc:
            raise self._fail(f"NIXL: {exc}") from exc
        finally:
            for handle in handles:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:   # still in flight: NIXL frees it with the agent
                    pass

    def _run(self, handle: Any) -> None:
        """Start one xfer and poll it to its end: at once and without pause for ``spin`` s (where
        CPUs are scarce a spinner would take the one NIXL's progress thread needs), then every PAUSE s."""
        state = self.agent.transfer(handle)
        if state == "ERR":
            raise self._fail("NIXL refused to start a read")
        spun = time.perf_counter() + self.spin
        while state == "PROC":
            if time.perf_counter() > spun:
                time.sleep(PAUSE)
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise self._fail("a NIXL read failed")

    def close(self) -> None:
        try:
            self.agent.remove_remote_agent(self.peer)
        except Exception:   # never connected: nothing to remove
            pass
