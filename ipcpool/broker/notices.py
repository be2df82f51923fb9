"""What the broker tells sessions besides the answer to their own request.

A seal settles the gets waiting for it and tells its pending readers and the watchers of its
prefix; an object that will never be sealed fails its waiting gets and tells its pending readers;
a growable buffer that grew tells its other holders; a wait that timed out is answered.
A growth notice for a session the message channel has not heard from yet (it spoke on the
control socket alone, its DEALER still connecting) waits until it is heard (``heard``): the
ROUTER would drop it. A client therefore never waits for its connect's ping before a growable
request.

Each message goes out through ``send`` the moment it is made, before the request that caused it
goes on: the readers of a seal hear of it before the seal's durable record is written.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import protocol
from ..errors import ObjectAborted, WaitTimeout
from .objects import NamedObject, ObjectTable
from ..replies import AbortNotice, GrowNotice, SealNotice, WatchNotice
from .replies import credit, lease, pending, ready_event
from .session import Session

# A message to the session of a token, on the message channel (the server's ROUTER).
Send = Callable[[bytes, dict], None]


class Notices:
    def __init__(self, objects: ObjectTable, sessions: dict[bytes, Session], send: Send,
                 wake: Callable[[str], None] = lambda pool: None,
                 wake_word: Callable[[str, int], None] = lambda pool, word: None):
        self.objects = objects
        self.sessions = sessions   # token -> open session (a message to any other is not sent)
        self.send = send
        self.wake = wake   # wakes the readers asleep on a pool's directory (``Directories.wake``)
        self.wake_word = wake_word   # ... and those asleep on a seal-board word (``Board.wake``)

    def _wake_board(self, obj: NamedObject) -> None:
        """Readers asleep on ``obj``'s board word see its end (a seal whose word was not posted,
        an abort) now, not after their sleep."""
        if obj.word is not None:
            self.wake_word(obj.alloc.pool.spec.name, obj.word)

    def _woken(self, obj: NamedObject, waiters: list) -> list:
        """Answer the gets among ``waiters`` that only wake a reader (its directory holds the rest,
        changed already), and wake those asleep on the directory; the other waiters."""
        rest = []
        for w in waiters:
            if w.wake is None:
                rest.append(w)
            elif w.session.token in self.sessions:
                self.send(w.session.token, protocol.ok_reply(w.rid))
        if len(rest) < len(waiters):
            self.wake(obj.alloc.pool.spec.name)
        return rest

    def pending(self, obj: NamedObject) -> None:
        """An object created with a seal-board word: the gets already waiting for it get a
        *pending* lease now, and watch the board from then on."""
        for w in self._woken(obj, self.objects.take_waiters(obj.name)):   # (the entry is written)
            if w.session.token in self.sessions:
                self.objects.lease_pending(w.session, obj.name)
                self.send(w.session.token, protocol.ok_reply(w.rid, **pending(obj).encode()))

    def sealed(self, obj: NamedObject) -> None:
        """A seal settles the gets waiting for it, tells pending readers (who may have seen it on
        the board already) and the watchers of its prefix."""
        self._wake_board(obj)
        if obj.pending:   # each with a credit for the free of its lease, kept off the pending answer's path
            aid, event, pool = obj.alloc.aid, ready_event(obj), obj.alloc.pool
            for reader in obj.pending:
                if reader.token in self.sessions:
                    self.send(reader.token, SealNotice(aid, event, pool.spec.name, credit(pool, reader)).encode())
            obj.pending = []
        for w in self._woken(obj, self.objects.take_waiters(obj.name)):
            if w.session.token in self.sessions:
                self.objects.lease(w.session, obj.name)
                fields = lease(obj, credit(obj.alloc.pool, w.session)).encode()
                self.send(w.session.token, protocol.ok_reply(w.rid, **fields))
        # One notice per watching session, however many of its watches match (its client gives
        # it to each): a session with thousands of watches costs a seal no more than one with one.
        info = None
        for session, wid in self.objects.watching_sessions(obj.name).items():
            info = info or obj.info()
            self.send(session.token, WatchNotice(wid, info).encode())

    def aborted(self, obj: NamedObject, waiters: list) -> None:
        """An object that will never be sealed: its waiting gets fail, its pending readers are told
        (each still frees its lease, as for any)."""
        self._wake_board(obj)
        for w in waiters:
            self.send(w.session.token, protocol.error_reply(w.rid, ObjectAborted.of(obj.name)))
        if any(w.wake is not None for w in waiters):   # (its entry is gone: they see it on waking)
            self.wake(obj.alloc.pool.spec.name)
        for reader in obj.pending:
            if reader.token in self.sessions:
                self.send(reader.token, AbortNotice(obj.alloc.aid, obj.name).encode())
        obj.pending = []

    def grown(self, g, others: list[Session]) -> None:
        """A growable buffer grew: its other holders map the new chunks."""
        if others:
            note = GrowNotice(g.name, g.gen, g.memory.size, len(g.memory.chunks)).encode()
            for other in others:
                if other.heard:
                    self.send(other.token, note)
                else:   # each note says the whole state: the newest is all it needs
                    other.unheard_growth[g.name] = note

    def heard(self, session: Session) -> None:
        """The session's first message on the message channel: the ROUTER knows it now, and
        the growth notices kept for it go (before the answer to that message)."""
        session.heard = True
        notes, session.unheard_growth = session.unheard_growth, {}
        for note in notes.values():
            self.send(session.token, note)

    def timed_out(self, now: float) -> None:
        """Gets whose wait for a seal ran out by ``now`` are answered so."""
        for name, w in self.objects.expired(now):
            self.send(w.session.token, protocol.error_reply(
                w.rid, WaitTimeout(f"object {name!r} was not sealed within the timeout")))
