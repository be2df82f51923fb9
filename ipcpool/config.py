"""Broker configuration: TOML in, a checked ``Config`` out. A bad value names its key."""

from __future__ import annotations

import difflib
import grp
import os
import pwd
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .backend import BACKENDS
from .backend.base import REUSE_POLICIES, PoolSpec
from .backend.records import SLAB_MEMORY
from .cpus import spin_default
from .errors import ConfigError
from .shm.growboard import MAX_SLOTS, SLOTS
from .shm.directory import CAPACITY as DIRECTORY
from .shm.directory import MAX_CAPACITY as MAX_DIRECTORY
from .sizes import parse_size


MIN_POOL = 1 << 20   # a max_size below this is a missing unit ("100" for "100G"), not a pool
SOCKET_MODE = 0o750  # the socket directory's mode by default: its owner and its group


@dataclass(frozen=True)
class Quota:
    bytes: int = 0     # 0: unlimited
    objects: int = 0   # named objects a uid may have at once; 0: unlimited


@dataclass(frozen=True)
class PoolAccess:
    """Who may use one pool (its FD, seal board, objects): by default every allowed peer."""
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    def allows(self, uid: int, gid: int, groups: tuple[int, ...]) -> bool:
        if not self.uids and not self.gids:
            return True
        return uid in self.uids or gid in self.gids or not self.gids.isdisjoint(groups)


# [limits] besides the counts: bytes the broker queues for a session that it has not read yet
# (replies and notices), per session and per uid; connections without a hello, per uid.
UNREAD_PER_SESSION = 32 << 20
UNREAD_PER_UID = 256 << 20
PENDING_HELLOS_PER_UID = 64


DEFAULT_NIXL_PORT = 5555   # NIXL's own default listener port
# [nixl] staging: how NIXL is given a version's memory (ipcpool.fleet.staging): "auto" (GPU
# buffers on CUDA, the memory itself on the host), or the first kind to try, each falling back to
# the next: "off" (the memory itself), "gpu" (GPU buffers), "host" (host buffers).
STAGINGS = ("auto", "off", "gpu", "host")


@dataclass(frozen=True)
class Fleet:
    """[nixl] and [peers]: this node among its peers (``ipcpool serve-peer``, ``ipcpool pull``)."""
    name: str = ""                          # this node's NIXL agent name; "": the host name
    port: int = DEFAULT_NIXL_PORT           # the serve-peer's NIXL listener (metadata exchange)
    serve: tuple[str, ...] = ()             # checkpoint name prefixes served to peers; none: nothing
    peers: dict[str, tuple[str, int]] = field(default_factory=dict)   # name -> (host, listener port)
    staging: str = "auto"                   # one of STAGINGS

    @property
    def agent(self) -> str:
        import socket

        return self.name or socket.gethostname()

    def serves(self, checkpoint: str) -> bool:
        return any(checkpoint.startswith(p) for p in self.serve)


@dataclass(frozen=True)
class Config:
    socket_dir: Path | None = None
    # The socket directory's group (and so its sockets'): who the filesystem lets reach the broker.
    # None: the broker's own group. By default the first group under [access].
    socket_group: int | None = None
    socket_mode: int = SOCKET_MODE
    backend: str = "auto"
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    pools: tuple[PoolSpec, ...] = (PoolSpec("default"),)
    quotas: dict[int, Quota] = field(default_factory=dict)
    default_quota: Quota = Quota()
    metrics_address: str = ""   # "host:port" of the Prometheus endpoint; empty: none
    busy_poll_us: int = 500     # after a request, poll without sleeping this long (0: never; 0 by default on < 4 CPUs)
    busy_poll_parked_us: int = 5000   # ... and this long after a get that parked (waits for an object)
    sessions_per_uid: int = 4096   # sessions (open or waiting for their process to exit) per uid; 0: no cap
    waits_per_uid: int = 4096      # gets parked until a seal, per uid; 0: no cap
    watches_per_uid: int = 4096    # prefix watches (subscriptions), per uid; 0: no cap
    growth_stock: int = 256 << 20  # bytes of chunks each pool keeps made for growable buffers (CUDA); 0: none
    growth_board: int = SLOTS      # growable buffers with a word on the growth board at once; 0: no board
    directory_entries: int = DIRECTORY   # named objects of a pool readers find without a reply; 0: none
    unread_bytes_per_session: int = UNREAD_PER_SESSION
    unread_bytes_per_uid: int = UNREAD_PER_UID
    pending_hellos_per_uid: int = PENDING_HELLOS_PER_UID
    pool_access: dict[str, PoolAccess] = field(default_factory=dict)   # pool -> who; absent: everyone
    fleet: Fleet = Fleet()

    def pool_allowed(self, pool: str, uid: int, gid: int, groups: tuple[int, ...]) -> bool:
        access = self.pool_access.get(pool)
        return access is None or access.allows(uid, gid, groups)

    def quota_for(self, uid: int) -> Quota:
        return self.quotas.get(uid, self.default_quota)

    def allowed(self, uid: int, gid: int, groups: tuple[int, ...] = ()) -> bool:
        """May a peer of ``uid``, primary ``gid`` and supplementary ``groups`` connect? A group
        grants access whether it is the primary one or not (``usermod -aG`` adds a supplementary)."""
        # Default (nothing configured): the broker's own uid and root.
        uids = self.allow_uids or frozenset({os.getuid(), 0})
        return uid in uids or gid in self.allow_gids or not self.allow_gids.isdisjoint(groups)


def _size(value: Any, key: str) -> int:
    """An int of bytes, or a string like "512M", "8GiB" (the parser the CLI uses too)."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _expect(value: Any, kind: type, key: str):
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def _busy_poll(data: dict, key: str, default: int) -> int:
    """A busy-poll span in µs: 0 to 0.1 s; by default ``default``, or 0 where spinning does not pay
    (``cpus.spin_default``)."""
    value = _expect(data.get(key, spin_default(default)), int, key)
    if not 0 <= value <= 100_000:
        raise ConfigError(f"{key}: 0 to 100000 microseconds, got {value}")
    return value


def _known(table: dict, keys: set[str], where: str) -> None:
    unknown = sorted(set(table) - keys)
    if unknown:
        hints = [f"{k} (did you mean {near[0]}?)" if (near := difflib.get_close_matches(k, keys, 1)) else k
                 for k in unknown]
        raise ConfigError(f"{where}: unknown key(s) {', '.join(hints)}; known: {', '.join(sorted(keys))}")


def _pool_access(table: dict, where: str) -> PoolAccess | None:
    """``uids``, ``gids`` and ``groups`` of a [[pools]] table: who may use it (none: everyone)."""
    if not any(k in table for k in ("uids", "gids", "groups")):
        return None
    uids = [_expect(u, int, f"{where}.uids[{i}]") for i, u in enumerate(_expect(table.get("uids", []), list, f"{where}.uids"))]
    gids = [_gid(g, f"{where}.gids[{i}]") for i, g in enumerate(_expect(table.get("gids", []), list, f"{where}.gids"))]
    gids += [_gid(g, f"{where}.groups[{i}]") for i, g in enumerate(_expect(table.get("groups", []), list, f"{where}.groups"))]
    if not uids and not gids:
        raise ConfigError(f"{where}: uids/gids/groups given but all empty: nobody could use this pool")
    return PoolAccess(frozenset(uids), frozenset(gids))


def _pool(table: Any, i: int) -> PoolSpec:
    where = f"pools[{i}]"
    _expect(table, dict, where)
    _known(table, {"name", "max_size", "release_threshold", "device", "reuse", "peer_access", "slab_memory",
                   "uids", "gids", "groups"}, where)
    name = _expect(table.get("name"), str, f"{where}.name")
    if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"{where}.name: 1-64 letters, digits, '-' or '_', got {name!r}")
    reuse = dict.fromkeys(REUSE_POLICIES, True)
    for k, v in _expect(table.get("reuse", {}), dict, f"{where}.reuse").items():
        if k not in REUSE_POLICIES:
            raise ConfigError(f"{where}.reuse.{k}: unknown policy; known: {', '.join(REUSE_POLICIES)}")
        reuse[k] = _expect(v, bool, f"{where}.reuse.{k}")
    threshold = table.get("release_threshold")
    peers = _expect(table.get("peer_access", []), list, f"{where}.peer_access")
    device = _expect(table.get("device", 0), int, f"{where}.device")
    if device < 0:
        raise ConfigError(f"{where}.device: must be >= 0")
    slab_memory = _expect(table.get("slab_memory", "pool"), str, f"{where}.slab_memory")
    if slab_memory not in SLAB_MEMORY:
        raise ConfigError(f"{where}.slab_memory: one of {', '.join(SLAB_MEMORY)}, got {slab_memory!r}")
    max_size = _size(table.get("max_size", 0), f"{where}.max_size")
    if 0 < max_size < MIN_POOL:   # it would refuse every allocation: say so now, not at each
        raise ConfigError(f"{where}.max_size: {max_size} bytes cannot serve an allocation; a pool needs "
                          f"at least 1M (sizes take a unit: \"512M\", \"{max_size}G\"), or 0 for the backend's default")
    return PoolSpec(
        name=name,
        max_size=max_size,
        release_threshold=None if threshold is None else _size(threshold, f"{where}.release_threshold"),
        device=device,
        reuse=reuse,
        peer_access=tuple(_expect(p, int, f"{where}.peer_access[{j}]") for j, p in enumerate(peers)),
        slab_memory=slab_memory,
    )


def _gid(value: Any, key: str) -> int:
    if isinstance(value, str):
        try:
            return grp.getgrnam(value).gr_gid
        except KeyError:
            raise ConfigError(f"{key}: no group named {value!r}") from None
    return _expect(value, int, key)


def _uid(value: Any, key: str) -> int:
    """A uid, or a user's name (looked up now: the broker starts knowing whom it means)."""
    if isinstance(value, str) and not value.isdigit():
        try:
            return pwd.getpwnam(value).pw_uid
        except KeyError:
            raise ConfigError(f"{key}: no user named {value!r}") from None
    return int(value) if isinstance(value, str) else _expect(value, int, key)


def _socket_mode(value: Any) -> int:
    """The socket directory's mode: an int (TOML 0o750) or a string of octal digits ("0750")."""
    if isinstance(value, str):
        try:
            value = int(value, 8)
        except ValueError:
            raise ConfigError(f"socket_mode: octal digits such as \"0750\", got {value!r}") from None
    mode = _expect(value, int, "socket_mode")
    # The owner needs everything; nobody else may write (replace a socket) or list it openly.
    if mode & ~0o777 or mode & 0o700 != 0o700 or mode & 0o022:
        raise ConfigError(f"socket_mode: rwx for the owner, no write for group or others (such as 0o750, "
                          f"0o770 is refused), got {oct(mode)}")
    return stat.S_IMODE(mode)


def _node_name(value: Any, key: str) -> str:
    name = _expect(value, str, key)
    if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"{key}: 1-64 letters, digits, '-', '_' or '.', got {name!r}")
    return name


def _port(value: Any, key: str) -> int:
    port = _expect(value, int, key)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{key}: a TCP port, 1 to 65535, got {port}")
    return port


def _fleet(data: dict[str, Any]) -> Fleet:
    nixl = _expect(data.get("nixl", {}), dict, "nixl")
    _known(nixl, {"name", "port", "serve", "staging"}, "nixl")
    name = _node_name(nixl["name"], "nixl.name") if "name" in nixl else ""
    port = _port(nixl.get("port", DEFAULT_NIXL_PORT), "nixl.port")
    serve = tuple(_expect(p, str, f"nixl.serve[{i}]") for i, p in enumerate(_expect(nixl.get("serve", []), list, "nixl.serve")))
    peers: dict[str, tuple[str, int]] = {}
    for key, value in _expect(data.get("peers", {}), dict, "peers").items():
        where = f"peers.{_node_name(key, 'peers')}"
        host, _, port_text = _expect(value, str, where).rpartition(":")
        if not host or not port_text.isdigit():
            raise ConfigError(f"{where}: expected \"host:port\" of the peer's NIXL listener (its [nixl] port), "
                              f"such as \"10.0.0.2:{DEFAULT_NIXL_PORT}\", got {value!r}")
        peers[key] = (host.strip("[]"), _port(int(port_text), where))
    staging = _expect(nixl.get("staging", "auto"), str, "nixl.staging")
    if staging not in STAGINGS:
        raise ConfigError(f"nixl.staging: one of {', '.join(STAGINGS)}, got {staging!r}")
    return Fleet(name=name, port=port, serve=serve, peers=peers, staging=staging)


def parse(data: dict[str, Any]) -> Config:
    _known(data, {"socket_dir", "socket_group", "socket_mode", "backend", "access", "pools", "quotas",
                  "metrics_address", "busy_poll_us", "busy_poll_parked_us", "limits", "growth", "handoff", "nixl", "peers"}, "config")
    fleet = _fleet(data)
    handoff = _expect(data.get("handoff", {}), dict, "handoff")
    _known(handoff, {"directory"}, "handoff")
    directory_entries = _expect(handoff.get("directory", DIRECTORY), int, "handoff.directory")
    if not 0 <= directory_entries <= MAX_DIRECTORY:
        raise ConfigError(f"handoff.directory: 0 (no directory) to {MAX_DIRECTORY} entries, got {directory_entries}")
    growth = _expect(data.get("growth", {}), dict, "growth")
    _known(growth, {"stock", "board"}, "growth")
    growth_stock = _size(growth.get("stock", 256 << 20), "growth.stock")
    growth_board = _expect(growth.get("board", SLOTS), int, "growth.board")
    if not 0 <= growth_board <= MAX_SLOTS:
        raise ConfigError(f"growth.board: 0 (no board) to {MAX_SLOTS} buffers, got {growth_board}")
    limits = _expect(data.get("limits", {}), dict, "limits")
    counts = ("sessions_per_uid", "waits_per_uid", "watches_per_uid")
    _known(limits, {*counts, "unread_bytes_per_session", "unread_bytes_per_uid", "pending_hellos_per_uid"}, "limits")
    caps = {}
    for key in counts:
        caps[key] = _expect(limits.get(key, 4096), int, f"limits.{key}")
        if not 0 <= caps[key] <= 1 << 30:
            raise ConfigError(f"limits.{key}: 0 (no cap) to {1 << 30}, got {caps[key]}")
    # A session must be able to hold at least two of the largest replies unread (protocol.MAX_REPLY).
    for key, default, least in (("unread_bytes_per_session", UNREAD_PER_SESSION, 32 << 20),
                                ("unread_bytes_per_uid", UNREAD_PER_UID, 32 << 20)):
        caps[key] = _size(limits.get(key, default), f"limits.{key}")
        if caps[key] < least:
            raise ConfigError(f"limits.{key}: at least {least >> 20} MiB (two of the largest replies), got {caps[key]}")
    caps["pending_hellos_per_uid"] = _expect(limits.get("pending_hellos_per_uid", PENDING_HELLOS_PER_UID), int,
                                             "limits.pending_hellos_per_uid")
    if not 1 <= caps["pending_hellos_per_uid"] <= 1 << 16:
        raise ConfigError(f"limits.pending_hellos_per_uid: 1 to {1 << 16}, got {caps['pending_hellos_per_uid']}")
    busy_poll_us, busy_poll_parked_us = (_busy_poll(data, key, default) for key, default in (
        ("busy_poll_us", Config.busy_poll_us), ("busy_poll_parked_us", Config.busy_poll_parked_us)))
    metrics_address = _expect(data.get("metrics_address", ""), str, "metrics_address")
    if metrics_address:
        host, _, port = metrics_address.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError(f"metrics_address: expected \"host:port\" such as \"127.0.0.1:9464\", got {metrics_address!r}")
    backend = _expect(data.get("backend", "auto"), str, "backend")
    if backend not in BACKENDS:
        raise ConfigError(f"backend: one of {', '.join(BACKENDS)}; got {backend!r}")
    access = _expect(data.get("access", {}), dict, "access")
    _known(access, {"uids", "gids", "groups"}, "access")
    uids = [_uid(u, f"access.uids[{i}]") for i, u in enumerate(_expect(access.get("uids", []), list, "access.uids"))]
    groups = [_gid(g, f"access.groups[{i}]") for i, g in enumerate(_expect(access.get("groups", []), list, "access.groups"))]
    gids = [_gid(g, f"access.gids[{i}]") for i, g in enumerate(_expect(access.get("gids", []), list, "access.gids"))]
    # A group [access] admits must reach the sockets too: the directory is its by default.
    group = data.get("socket_group", (groups + gids)[0] if groups or gids else "")
    socket_group = None if group == "" else _gid(group, "socket_group")
    socket_mode = _socket_mode(data.get("socket_mode", SOCKET_MODE))
    pools_raw = data.get("pools", [{"name": "default"}])
    if isinstance(pools_raw, dict):   # [pools.default] / [pools] instead of [[pools]]
        example = next(iter(pools_raw), "default")
        raise ConfigError(f"pools: a list of [[pools]] tables is expected, one per pool with its name inside; "
                          f"write [[pools]] then name = \"{example}\" instead of [pools.{example}]")
    pools_raw = _expect(pools_raw, list, "pools")
    pools = tuple(_pool(t, i) for i, t in enumerate(pools_raw))
    pool_access = {p.name: a for i, (p, t) in enumerate(zip(pools, pools_raw))
                   if (a := _pool_access(t, f"pools[{i}]")) is not None}
    if not pools:
        raise ConfigError("pools: at least one pool is needed")
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ConfigError(f"pools: duplicate pool names in {names}")
    quotas_raw = _expect(data.get("quotas", {}), dict, "quotas")
    default_quota = Quota()
    quotas: dict[int, Quota] = {}
    for key, table in quotas_raw.items():
        _expect(table, dict, f"quotas.{key}")
        _known(table, {"bytes", "objects"}, f"quotas.{key}")
        objects = _expect(table.get("objects", 0), int, f"quotas.{key}.objects")
        if objects < 0:
            raise ConfigError(f"quotas.{key}.objects: must not be negative, got {objects}")
        quota = Quota(bytes=_size(table.get("bytes", 0), f"quotas.{key}.bytes"), objects=objects)
        if key == "default":
            default_quota = quota
        else:   # a uid, or a user's name
            try:
                quotas[_uid(key, f"quotas.{key}")] = quota
            except ConfigError:
                raise ConfigError(f"quotas.{key}: expected a uid, a user's name or 'default'; "
                                  f"no user named {key!r}") from None
    socket_dir = data.get("socket_dir")
    return Config(
        socket_dir=Path(_expect(socket_dir, str, "socket_dir")) if socket_dir is not None else None,
        socket_group=socket_group,
        socket_mode=socket_mode,
        backend=backend,
        allow_uids=frozenset(uids),
        allow_gids=frozenset(groups + gids),
        pools=pools,
        quotas=quotas,
        default_quota=default_quota,
        metrics_address=metrics_address,
        busy_poll_us=busy_poll_us,
        busy_poll_parked_us=busy_poll_parked_us,
        growth_stock=growth_stock,
        growth_board=growth_board,
        directory_entries=directory_entries,
        pool_access=pool_access,
        fleet=fleet,
        **caps,
    )


def load(path: str | os.PathLike | None) -> Config:
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
    return parse(data)
