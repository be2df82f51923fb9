"""Fuzz a running broker with malformed frames on both sockets, and check how it answers.

Seeded, so a failing run can be replayed. On the message channel (one raw session) it sends
frames of every kind: random bytes, bit-flipped and truncated requests, wrong field types,
missing and extra fields, str/bytes key mixes, unknown and over-long ops, bad ids (-1, nil, a
string, a float, a bool, >= 2**63), extra frames, deep nesting, huge values, and valid requests
among them. On the control socket it sends hellos of the same kinds on fresh connections (some
with FDs attached or over the size limit) and bad messages inside open sessions.

After every batch the broker must still serve (a ping on the fuzzed session, and on control
batches a fresh client's stats); over the whole run there must be no internal-error reply, no
``ok`` reply to a request malformed by construction (or refused by the protocol's own checks),
and no reply a client cannot decode (``protocol.unpack`` with the client's limits).

    python tests/fuzz/fuzz_broker.py                                   # 100k ZeroMQ + 10k control frames
    python tests/fuzz/fuzz_broker.py --zmq 5000 --control 500 --seed 7
    python tests/fuzz/fuzz_broker.py --socket-dir /run/ipcpool         # a broker that is running already

The test suite runs a small seeded run (tests/integration/test_fuzz.py); docs/reliability.md
gives the long run's figures.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import random
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zmq  # noqa: E402

import ipcpool  # noqa: E402
from tests.fuzz.frames import (  # noqa: E402
    CONTROL_KINDS,
    MALFORMED,
    ZMQ_KINDS,
    control_payload,
    locally_malformed,
    session_payload,
    zmq_frame,
)
from tests.fuzz.verdict import BrokerDown, Checker, Summary, is_internal  # noqa: E402
from ipcpool import fdpass, protocol  # noqa: E402
from ipcpool.errors import IpcPoolError  # noqa: E402
from ipcpool.progress import Progress  # noqa: E402

__all__ = ["MALFORMED", "Summary", "fuzz", "main"]

BARRIER = 1 << 62   # ids of the pings that close each batch (fuzzed ids stay below)


# -- the message channel ------------------------------------------------------------------------------
class RawSession:
    """A session opened by hand: its control socket and a DEALER with its token."""

    def __init__(self, socket_dir: Path, zctx: zmq.Context):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(10)
        self.sock.connect(str(Path(socket_dir) / "broker.sock"))
        fdpass.send(self.sock, {"op": "hello", "version": protocol.PROTOCOL_VERSION})
        got = fdpass.recv(self.sock)
        if got is None or not got[0].get("ok"):
            raise BrokerDown(f"hello refused: {got}")
        self.hello = got[0]
        self.dealer = dealer(zctx, self.hello["token"], self.hello["endpoint"])

    def bye(self) -> None:
        """End the session now (the broker ends it at once even after it dropped the control socket)."""
        try:
            self.dealer.send(protocol.pack({"op": "bye", "id": BARRIER - 1}))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                reply = protocol.unpack(self.dealer.recv(), protocol.MAX_REPLY)
                if reply.get("id") == BARRIER - 1:
                    break
        except zmq.Again:
            pass
        finally:
            self.dealer.close(linger=0)
            self.sock.close()


def dealer(zctx: zmq.Context, token: bytes, endpoint: str) -> zmq.Socket:
    d = zctx.socket(zmq.DEALER)
    d.setsockopt(zmq.IDENTITY, token)
    d.setsockopt(zmq.RCVTIMEO, 10_000)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY)
    d.connect(endpoint)
    return d


def fuzz_zmq(rng: random.Random, sess: RawSession, checker: Checker, frames: int, batch: int, progress) -> None:
    s = checker.s
    sent = 0
    n_batch = 0
    while sent < frames:
        checker.valid_id0 = 0
        for _ in range(min(batch, frames - sent)):
            kind = rng.choice(ZMQ_KINDS)
            rid = rng.randrange(1, BARRIER - 2)
            parts = zmq_frame(rng, kind, rid)
            if kind in MALFORMED or locally_malformed(parts):
                checker.malformed[rid] = kind
            elif kind == "bitflip":
                msg = protocol.unpack(parts[0])
                if msg.get("id") == 0:
                    checker.valid_id0 += 1
                else:
                    checker.malformed.pop(msg.get("id"), None)
            s.by_kind[kind] = s.by_kind.get(kind, 0) + 1
            sess.dealer.send_multipart(parts)
            sent += 1
        n_batch += 1
        barrier = BARRIER + n_batch
        sess.dealer.send(protocol.pack({"op": "ping", "id": barrier}))
        while True:
            try:
                data = sess.dealer.recv()
            except zmq.Again:
                raise BrokerDown(f"no answer to the ping after batch {n_batch} ({sent} frames)") from None
            reply = checker.reply(data, "zmq")
            if reply is None or "notify" in reply:
                continue
            s.zmq_replies += 1
            if reply.get("id") == barrier:
                if not reply.get("ok"):
                    raise BrokerDown(f"the ping after batch {n_batch} failed: {reply}")
                s.zmq_replies -= 1
                break
        if rng.random() < 0.05 and sent < frames:   # a frame over the size limit, on its own
            oversized(rng, sess, checker, n_batch)
            sent += 1
        s.zmq_frames = sent
        s.batches += 1
        s.alive_checks += 1
        progress(0, sent)


def oversized(rng: random.Random, sess: RawSession, checker: Checker, n_batch: int) -> None:
    """A frame over MAX_MESSAGE: libzmq drops the connection without a reply, the DEALER connects
    again by itself, and the session goes on (pings until one is answered)."""
    s = checker.s
    s.by_kind["oversized"] = s.by_kind.get("oversized", 0) + 1
    sess.dealer.send(b"\x81\xa2op" + rng.randbytes(protocol.MAX_MESSAGE + rng.randint(1, 4096)))
    sess.dealer.setsockopt(zmq.RCVTIMEO, 200)
    try:
        pings = set()
        deadline = time.monotonic() + 15
        while True:
            if time.monotonic() > deadline:
                raise BrokerDown(f"no answer after an oversized frame (batch {n_batch})")
            ping = BARRIER + (1 << 40) + n_batch * 1000 + len(pings)
            pings.add(ping)
            sess.dealer.send(protocol.pack({"op": "ping", "id": ping}))
            try:
                while True:
                    reply = checker.reply(sess.dealer.recv(), "zmq")
                    if reply is not None and reply.get("id") in pings and reply.get("ok"):
                        return
            except zmq.Again:
                continue
    finally:
        sess.dealer.setsockopt(zmq.RCVTIMEO, 10_000)


# -- the control socket -------------------------------------------------------------------------------
def _control_replies(checker: Checker, sock: socket.socket, malformed: bool | None, payload: bytes,
                     one: bool = False) -> list[dict]:
    """Every reply up to EOF (``one``: the first reply); closes the FDs that come with them."""
    out = []
    sock.settimeout(5.0)
    while True:
        try:
            data, anc, _flags, _ = sock.recvmsg(protocol.MAX_REPLY, socket.CMSG_SPACE(64 * 4))
        except (TimeoutError, socket.timeout):
            break
        except OSError:
            break
        for level, kind, payload_fds in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload_fds[: len(payload_fds) - len(payload_fds) % 4])
                for fd in arr:
                    os.close(fd)
        if not data:
            break
        checker.s.control_replies += 1
        try:
            reply = protocol.unpack(data, protocol.MAX_REPLY)
        except IpcPoolError as exc:
            checker.s.undecodable.append(("control", str(exc)[:200], data[:100]))
            continue
        if reply.get("ok"):
            if malformed is None:
                try:
                    op, _ = protocol.validate(protocol.unpack(payload), protocol.CONTROL)
                    malformed = False
                except IpcPoolError:
                    malformed = True
            if malformed:
                checker.s.ok_to_malformed.append(("control", payload[:80], reply))
            else:
                checker.s.ok_to_valid += 1
        else:
            checker.s.error_replies += 1
            if is_internal(reply):
                checker.s.internal_errors.append(("control", reply.get("error")))
        out.append(reply)
        if one or (reply.get("ok") and "token" in reply):
            break   # one answer to a message in a session; or a session opened (a hello that survived its bit flips): the caller ends it
    return out


def fuzz_control(rng: random.Random, socket_dir: Path, zctx: zmq.Context, checker: Checker,
                 frames: int, batch: int, progress) -> None:
    s = checker.s
    path = str(Path(socket_dir) / "broker.sock")
    sent = 0
    while sent < frames:
        for _ in range(min(batch, frames - sent)):
            kind = rng.choice(CONTROL_KINDS)
            s.by_kind[f"control:{kind}"] = s.by_kind.get(f"control:{kind}", 0) + 1
            if kind == "in_session":
                sess = RawSession(socket_dir, zctx)
                try:
                    for _ in range(rng.randint(1, 5)):
                        payload, malformed, ends = session_payload(rng)
                        sess.sock.send(payload)
                        sent += 1
                        _control_replies(checker, sess.sock, malformed, payload, one=not ends)
                        if ends:
                            break
                finally:
                    sess.bye()
                continue
            payload, fds, malformed = control_payload(rng, kind)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.settimeout(10)
                sock.connect(path)
                try:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                    sock.sendmsg([payload], anc)
                except OSError:   # EMSGSIZE: the kernel refuses a datagram over the socket's limit
                    pass
                sent += 1
                replies = _control_replies(checker, sock, malformed, payload)
                opened = [r for r in replies if r.get("ok") and "token" in r]
                if opened:   # end that session cleanly
                    d = dealer(zctx, opened[0]["token"], opened[0]["endpoint"])
                    d.send(protocol.pack({"op": "bye", "id": 1}))
                    try:
                        d.recv()
                    except zmq.Again:
                        pass
                    d.close(linger=0)
            finally:
                sock.close()
                for fd in fds:
                    os.close(fd)
        alive(socket_dir)
        s.control_frames = sent
        s.batches += 1
        s.alive_checks += 1
        progress(0, sent)


def alive(socket_dir: Path) -> None:
    try:
        with ipcpool.connect(socket_dir, timeout=10, arena_bytes=0) as c:
            c.stats()
    except IpcPoolError as exc:
        raise BrokerDown(f"the broker no longer serves a fresh client: {exc}") from exc


def fuzz(socket_dir: Path, *, seed: int = 12, zmq_frames: int = 100_000, control_frames: int = 10_000,
         batch: int = 250, show_progress: bool = False, broker_pid: int | None = None) -> Summary:
    """Run the fuzz against the broker serving ``socket_dir``; the summary says what it found."""
    rng = random.Random(seed)
    summary = Summary(seed)
    checker = Checker(summary)
    zctx = zmq.Context()
    t0 = time.monotonic()
    bars = []
    try:
        for label, total, run in (
            ("ZeroMQ frames", zmq_frames, lambda p: fuzz_zmq(rng, sess, checker, zmq_frames, batch, p)),
            ("control frames", control_frames,
             lambda p: fuzz_control(rng, socket_dir, zctx, checker, control_frames, max(1, batch // 10), p)),
        ):
            if total <= 0:
                continue
            bar = Progress(label, total) if show_progress else None
            bars.append(bar)
            last = [0]

            def progress(_n, done, bar=bar, last=last):
                if broker_pid is not None and not _pid_alive(broker_pid):
                    raise BrokerDown(f"broker pid {broker_pid} exited")
                if bar is not None:
                    bar.update(done - last[0])
                    last[0] = done

            sess = RawSession(socket_dir, zctx)
            try:
                run(progress)
            finally:
                sess.bye()
                if bar is not None:
                    bar.close()
        alive(socket_dir)
    finally:
        zctx.term()
        summary.seconds = round(time.monotonic() - t0, 2)
    return summary


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie child is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zmq", type=int, default=100_000, help="frames on the message channel")
    ap.add_argument("--control", type=int, default=10_000, help="frames on the control socket")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--batch", type=int, default=250, help="frames between two liveness checks")
    ap.add_argument("--socket-dir", help="fuzz the broker serving this directory (default: start one)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()

    def run(socket_dir, pid=None):
        return fuzz(Path(socket_dir), seed=args.seed, zmq_frames=args.zmq, control_frames=args.control,
                    batch=args.batch, show_progress=True, broker_pid=pid)

    if args.socket_dir:
        summary = run(args.socket_dir)
    else:
        from bench.common import broker

        with broker("host") as socket_dir:
            summary = run(socket_dir)
    d = summary.as_dict()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(f"seed {d['seed']}: {d['zmq_frames']} ZeroMQ frames ({d['zmq_replies']} replies), "
              f"{d['control_frames']} control frames ({d['control_replies']} replies) in {d['seconds']} s, "
              f"{d['batches']} batches, broker alive after each")
        print(f"  error replies {d['error_replies']}, ok replies to valid requests {d['ok_to_valid']}")
        print(f"  internal errors {d['internal_errors']}, ok to malformed {d['ok_to_malformed']}, "
              f"undecodable replies {d['undecodable']}")
        for k in ("internal_errors", "ok_to_malformed", "undecodable"):
            for ex in d[f"{k}_examples"]:
                print(f"    {k}: {ex}")
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
