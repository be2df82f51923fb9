"""What the broker queues on the message channel, bounded in bytes per session and per uid.

ZeroMQ's own bound (the high-water mark) counts messages, and what a ROUTER sends to a peer that
does not read sits in the broker's memory: 1,000 replies of 8 MB is 8 GB. Here every message to
a session is counted (``sent_bytes``), and the client says on each request how many bytes it has
taken in (``read``; a client that only reads notices sends an ``ack`` now and then): the
difference is what the broker may be holding for it, charged to the session and to its uid.

- A reply over ``protocol.MAX_REPLY`` is never sent: the client could not take it in (its
  MAXMSGSIZE), and would wait out its timeout for it. It becomes an error naming the limit.
- A large reply (over LARGE) that would take a session or its uid past its budget is refused the
  same way; small replies still go, so that a client always learns why.
- A watch notice that finds no room is dropped and counted; the session is told how many once it
  has room again (``notify: overflow``).
- A session whose small messages pile up past its budget by SLACK is disconnected, with the reason
  logged and sent on its control socket.
- A peer without a live session gets a few error replies, then nothing (logged, counted).

With this, the router's high-water marks are lifted (``unlimited``): nothing is dropped silently
because a client has thousands of requests in flight.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import zmq

from .. import protocol
from ..config import Config
from .session import Session

log = logging.getLogger(__name__)

LARGE = 128 << 10           # a reply above this is refused when over budget (a get's is below it)
SLACK = 4 << 20             # small messages tolerated past the budget before a disconnect
UNKNOWN_REPLIES = 8         # error replies per routing id without a live session
UNKNOWN_TRACKED = 4096      # routing ids remembered for that count (then forgotten all at once)


class Outbox:
    def __init__(self, router: zmq.Socket, sessions: dict[bytes, Session], config: Config,
                 disconnect: Callable[[Session, str], None]):
        self.router = router
        self.sessions = sessions   # token -> session
        self.config = config
        self.disconnect = disconnect   # ends a session that does not read (server: log, tell, orphan)
        self.unread_by_uid: collections.Counter = collections.Counter()
        self._unknown: dict[bytes, int] = {}
        self.dropped = collections.Counter()   # why -> messages not sent
        self._said_at = 0.0

    # -- budgets ---------------------------------------------------------------------------------
    def read(self, session: Session, value: object) -> None:
        """The client's report of bytes taken in (a request's ``read`` field)."""
        if type(value) is not int or not session.read_bytes < value <= session.sent_bytes:
            return
        self.unread_by_uid[session.cred.uid] -= value - session.read_bytes
        session.read_bytes = value
        if session.dropped_notices and self.over(session, 0) is None:
            dropped, session.dropped_notices = session.dropped_notices, 0
            self._send(session, protocol.pack({"notify": "overflow", "dropped": dropped}))

    def over(self, session: Session, nbytes: int) -> str | None:
        """Why ``nbytes`` more would pass the session's or its uid's budget (None: they fit)."""
        uid = session.cred.uid
        if session.unread + nbytes > self.config.unread_bytes_per_session:
            return (f"this session has {session.unread} bytes of replies and notices it has not read, "
                    f"and the broker queues at most {self.config.unread_bytes_per_session} for one session "
                    "(unread_bytes_per_session in the broker's [limits])")
        if self.unread_by_uid[uid] + nbytes > self.config.unread_bytes_per_uid:
            return (f"uid {uid}'s sessions have {self.unread_by_uid[uid]} bytes of replies and notices they "
                    f"have not read, and the broker queues at most {self.config.unread_bytes_per_uid} for one "
                    "uid (unread_bytes_per_uid in the broker's [limits])")
        return None

    def refusal(self, session: Session, op: str, nbytes: int) -> str | None:
        """Why the reply to ``op`` of ``nbytes`` must not be sent (None: it may)."""
        if nbytes > protocol.MAX_REPLY:
            return (f"the reply to {op} would be {nbytes} bytes, over the limit of {protocol.MAX_REPLY} bytes "
                    "a reply may have; ask for less at once (fewer names, a smaller page)")
        if nbytes > LARGE:
            why = self.over(session, nbytes)
            if why is not None:
                return f"the reply to {op} ({nbytes} bytes) was not sent: {why}; read replies before asking for more"
        return None

    def forget(self, session: Session) -> None:
        """An ended session: what it left unread is no longer charged (its connection goes too)."""
        uid = session.cred.uid
        self.unread_by_uid[uid] -= session.unread
        if self.unread_by_uid[uid] <= 0:
            del self.unread_by_uid[uid]
        session.read_bytes = session.sent_bytes

    # -- sending ---------------------------------------------------------------------------------
    def send(self, ident: bytes, msg: dict) -> None:
        """A message to the peer of routing id ``ident``: a session's, within its budget."""
        session = self.sessions.get(ident)
        if session is None or session.orphaned:
            self.to_stranger(ident, msg)
            return
        data = protocol.pack(msg)
        if "watch" in msg and "notify" in msg and self.over(session, len(data)) is not None:
            session.dropped_notices += 1
            self._drop("watch notice for a session without room", session)
            return
        self.send_packed(session, data)

    def send_packed(self, session: Session, data: bytes) -> None:
        """A reply already packed (and checked by ``refusal``)."""
        self._send(session, data)
        if session.unread > self.config.unread_bytes_per_session + SLACK or \
                self.unread_by_uid[session.cred.uid] > self.config.unread_bytes_per_uid + SLACK:
            self.disconnect(session, f"{self.over(session, 0)}; it does not read its replies")

    def to_stranger(self, ident: bytes, msg: dict) -> None:
        """An error reply to a peer without a live session: a few, then nothing (it may never read)."""
        n = self._unknown.get(ident, 0)
        if n >= UNKNOWN_REPLIES:
            self._drop("reply to a peer without a session (it had its share)", None)
            return
        if len(self._unknown) >= UNKNOWN_TRACKED:
            self._unknown.clear()
        self._unknown[ident] = n + 1
        self._raw(ident, protocol.pack(msg), None)

    def _send(self, session: Session, data: bytes) -> None:
        if self._raw(session.token, data, session):
            session.sent_bytes += len(data)
            self.unread_by_uid[session.cred.uid] += len(data)

    def _raw(self, ident: bytes, data: bytes, session: Session | None) -> bool:
        try:
            self.router.send_multipart([ident, data], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:   # EHOSTUNREACH (ROUTER_MANDATORY): its connection is gone
            self._drop(f"message channel: {exc.strerror}", session)
            return False

    def _drop(self, why: str, session: Session | None) -> None:
        self.dropped[why] += 1
        now = time.monotonic()
        if now - self._said_at >= 1.0:   # at most a line a second, with the counts so far
            self._said_at = now
            who = f"session {session.sid}" if session is not None else "a peer"
            log.warning("not sent (latest: %s, to %s); so far: %s", why, who,
                        ", ".join(f"{k}: {v}" for k, v in self.dropped.items()))
