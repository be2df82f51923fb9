"""A session's request ring: a writer's create and seal frames, in shared memory for a busy-polling broker.

A carved create sent on the control socket costs its writer a system call (~5 µs on an H100 host,
and ~10 µs more on the writer's next torch op, whose caches the call disturbed) and the broker a
poll and a receive before it can write the object's directory entry, which a reader waits for.
While the broker busy-polls it reads this ring instead, each turn of its loop: the frame is the
same bytes (``ipcpool.frames``), handled by the same code, answered on the message channel. The
seal goes the same way (after its board word, which readers watch: off their path, but a writer
that makes no system call keeps its caches for its next object).

Where it lies: the second and third pages of the session's lease page (``shm.leases``), the
session's own memfd, so only that session and the broker see it. Layout (little-endian): ``head``
(u64, the client's: frames written), ``tail`` at +64 (u64, the broker's: frames taken), then
``SLOTS`` slots of ``SLOT`` bytes at +128: a frame's length (u32), then the frame. The client
writes a slot, then ``head``; the broker reads ``head``, then the slots (x86 keeps both orders),
copies each frame out before it reads it, then writes ``tail``.

When the ring is used: only while the broker says in each pool's directory header that it polls
until a moment (``Directory.awake``) at least ``MARGIN_NS`` away, before and after the write. The
broker reads every ring once more after that moment before it sleeps, and between receiving any
other request of a session (socket frame or message) and handling it, it takes that session's ring,
so a frame here is never overtaken by the same session's later requests (a take before the
receive could miss a frame put meanwhile). Where the moment passed meanwhile, the
client sends a nudge (``frames.NUDGE``) on its socket, which wakes the broker. So no frame waits
on timing for more than the broker's next turn; correctness never depends on it.

A steady writer's frames are built ahead (``frames.completed``) and put in C where the package has
it (``_native.c``'s ``ring_put``, this layout and rule in one call; its seal's ``seal_put``, the
event record and board post first in the same call): the client's count of frames written is
``head`` itself, so the C and Python puts share it.

A client that writes garbage here harms only itself: the broker checks ``head`` against what it
has taken, each length against the slot, and each frame as one from the socket; a ring that does
not add up ends the session, as a malformed control message does.
"""

from __future__ import annotations

import mmap
import struct
from typing import TYPE_CHECKING, NamedTuple

from ..errors import ProtocolError
from . import sealing

try:   # a frame built ahead, completed and put in one call (``_native.c``) where built: ``Route``;
    # a seal's, after its record and board post in the same call (``put_sealed``)
    from ._native import ring_put as put_ready, seal_put as put_sealed
except ImportError:   # (no C compiler at install: ``Channel.send_ready`` completes it in Python)
    put_ready = put_sealed = None

if TYPE_CHECKING:
    from .directory import DirectoryView

AT = mmap.PAGESIZE          # where the ring starts in the session's page
LENGTH = 2 * mmap.PAGESIZE
SLOT = 512
_SLOTS_AT = 128
SLOTS = (LENGTH - _SLOTS_AT) // SLOT
MAX_FRAME = SLOT - 4
MARGIN_NS = 20_000          # the broker must poll at least this much longer for the ring to be used
_HEAD_WORD, _TAIL_WORD = AT // 8, (AT + 64) // 8   # (as ``sealing.words``)
_U32 = struct.Struct("<I")


class _Ring:
    __slots__ = ("_map", "_words")

    def __init__(self, mapping: mmap.mmap):
        self._map = mapping
        self._words = sealing.words(mapping)

    def close(self) -> None:
        """Before the map closes (it cannot while a view of it lives)."""
        self._words.release()


class RingReader(_Ring):
    """The broker's side of one session's ring."""

    __slots__ = ("_count",)

    def __init__(self, mapping: mmap.mmap):
        super().__init__(mapping)
        self._count = 0   # frames taken (the client's count is ``head``)

    def waiting(self) -> bool:
        return self._words[_HEAD_WORD] != self._count

    def take(self) -> list[bytes]:
        """Copies of the frames written since the last take; ProtocolError where the ring does
        not add up (the session is then ended)."""
        m, tail = self._map, self._count
        head = self._words[_HEAD_WORD]
        if head == tail:
            return []
        if not 0 < head - tail <= SLOTS:
            raise ProtocolError(f"this session's request ring does not add up (head {head} against {tail} "
                                "taken): the broker ended the session")
        frames = []
        while tail != head:
            at = AT + _SLOTS_AT + (tail % SLOTS) * SLOT
            n = _U32.unpack_from(m, at)[0]
            if not 0 < n <= MAX_FRAME:
                raise ProtocolError(f"this session's request ring does not add up (a frame of {n} bytes in "
                                    f"a slot of {MAX_FRAME}): the broker ended the session")
            frames.append(m[at + 4: at + 4 + n])   # (a copy: the client may write the slot again)
            tail += 1
        self._count = tail
        self._words[_TAIL_WORD] = tail   # the slots are the client's again
        return frames


class RingWriter(_Ring):
    """A client's side of its session's ring; ``mapping``, its page as the C put takes it (the
    lease page's, pinned: ``sealing.pinned``)."""

    __slots__ = ("mapping",)

    def __init__(self, mapping: mmap.mmap, pinned: object = None):
        super().__init__(mapping)
        self.mapping = mapping if pinned is None else pinned

    def put(self, frame: bytes) -> bool:
        """Write ``frame``; False where it does not fit or every slot waits for the broker."""
        n, words, m = len(frame), self._words, self._map
        head = words[_HEAD_WORD]   # (ours alone to write; ``put_ready`` counts here too)
        if n > MAX_FRAME or head - words[_TAIL_WORD] >= SLOTS:
            return False
        at = AT + _SLOTS_AT + (head % SLOTS) * SLOT
        _U32.pack_into(m, at, n)
        m[at + 4: at + 4 + n] = frame
        words[_HEAD_WORD] = head + 1   # the frame is whole before the broker can count it
        return True


class Route(NamedTuple):
    """Where a session's hand-off frames go while the broker reads its ring: ``writer``, the ring;
    ``view``, the directory whose header says how long the broker polls (``Channel.send_frame``'s
    rule); ``maps``, the two as ``put_ready`` takes them. A frame built ahead (``frames.completed``'s)
    is completed with its id and name and written in that one C call,
    ``put_ready(*route.maps, frame, name_len_at, rid, name)``, no Python call around it (each costs
    a writer back from sleep ~1 µs on an H100 host): 1 written; 2 written, but the broker may have
    stopped polling meanwhile (nudge it); 0 not written (send it on the socket). A seal's frame
    goes with its record and board post before it, ``put_sealed(event, stream, board, word, seq,
    *route.maps, frame, name_len_at, rid, name)``: the same answers once recorded and posted, below
    0 where nothing was done (-1 no CUDA driver loaded, else -1 - the record's CUresult). Both are
    None where the C part is not built (or switched off: ``shm.native``)."""

    writer: RingWriter
    view: DirectoryView
    maps: tuple[mmap.mmap, mmap.mmap]

    @classmethod
    def of(cls, writer: RingWriter, view: DirectoryView) -> Route:
        return cls(writer, view, (writer.mapping, view.mapping))
