"""Who may use which pool: a pool's FD, its seal board, its chunks and its objects go only to the
sessions the config lets use it (``[[pools]]`` ``uids``/``gids``/``groups``; by default every
allowed peer). A pool is a trust boundary: every client that maps it can write all of it.

Checked where memory or a way to it leaves the broker: the control socket's FD replies, and the
message channel's requests that name a pool, an object or a growable buffer."""

from __future__ import annotations

from ..config import Config
from ..errors import PeerRefused
from .session import Session
from .tables import Tables

# Message-channel ops whose target pool is named by an object (``name``/``names``) or a growable.
_BY_OBJECT = frozenset({"get", "get_many"})
_BY_GROWABLE = frozenset({"grow_attach", "grow", "grow_detach", "grow_delete", "grow_sync"})


class PoolAccess:
    def __init__(self, config: Config, tables: Tables):
        self.config = config
        self.tables = tables
        self.restricted = bool(config.pool_access)   # nothing to look up where no pool is restricted

    def check(self, session: Session, pool: str) -> None:
        """Refuse ``session`` the pool named ``pool`` (a restored generation ``name~n`` is its pool's)."""
        name = pool.split("~", 1)[0]
        cred = session.cred
        if not self.config.pool_allowed(name, cred.uid, cred.gid, session.groups):
            raise PeerRefused(
                f"uid {cred.uid} may not use pool {name!r}: the broker's config lists who may (uids, gids "
                "or groups under its [[pools]] entry); ask the operator")

    def check_pool(self, session: Session, pool: str) -> None:
        """Before a request that names ``pool`` and reaches nothing else runs (a create frame)."""
        if self.restricted:
            self.check(session, pool)

    def check_request(self, session: Session, op: str, fields: dict) -> None:
        """Before a request runs: the pool it names or reaches (an unknown name is the handler's to report)."""
        if not self.restricted:
            return
        if "pool" in fields:
            self.check_pool(session, fields["pool"])
        if op in _BY_OBJECT:
            objects = self.tables.objects.objects
            for name in fields.get("names") or (fields["name"],):
                obj = objects.get(name)
                if obj is not None:
                    self.check(session, obj.alloc.pool.spec.name)
        elif op in _BY_GROWABLE or (op == "chunk_fds" and "growable" in fields):
            g = self.tables.growables.by_name.get(fields.get("growable") or fields["name"])
            if g is not None:
                self.check(session, g.pool)
        elif op == "open":   # a shared allocation's token
            alloc = self.tables.registry.by_token.get(fields["token"])
            if alloc is not None:
                self.check(session, alloc.pool.spec.name)

    def allowed_pools(self, uid: int, gid: int, groups: tuple[int, ...]) -> list[str]:
        return sorted(n for n in self.tables.registry.pools if self.config.pool_allowed(n.split("~", 1)[0], uid, gid, groups))
