"""Trace events (``ipcpool.trace``) from a real broker and real clients on the host backend: a
hand-off's events in the order they happen, in the clients' process and, subscribed through
``IPCPOOL_TRACE``, in the broker's; a subscriber that raises, in either, costs the hand-off nothing."""

import os
import time

import ipcpool
from ipcpool import trace
from tests.support.cli import ipcpool_cmd
from tests.support.tracing import broker_env, read

MiB = 1 << 20
BYTES = {"dtype": "uint8", "shape": [MiB]}   # (what get_arrays needs to make an array)


def _write(socket_dir, name: str) -> None:
    with ipcpool.connect(socket_dir) as w:
        buf = w.create(name, MiB, meta=BYTES)
        buf.view[:4] = b"seal"
        buf.seal()
        w.flush()


def _read(socket_dir, name: str) -> bytes:
    with ipcpool.connect(socket_dir) as r:
        return bytes(r.get_arrays([name])[name][:4])


def test_a_writers_and_a_readers_events_in_their_order(broker):
    writer, reader = [], []
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        r.stats()   # (the connect's own answer taken in: only the attach's below)
        with trace.tracing(lambda event, info: writer.append((event, dict(info)))):
            buf = w.create("t/1", MiB, meta=BYTES)
            buf.view[:4] = b"seal"
            buf.seal()
        w.flush()
        with trace.tracing(lambda event, info: reader.append((event, dict(info)))):
            arrays = r.get_arrays(["t/1"])
        assert bytes(arrays["t/1"][:4]) == b"seal"
        del arrays
    sent = [(e, i) for e, i in writer if e.endswith("_sent")]
    assert [(e, i["name"], i["framed"]) for e, i in sent] == [("client.create_sent", "t/1", True),
                                                              ("client.seal_sent", "t/1", True)]
    assert sent[0][1]["op"] == "create" and sent[0][1]["rid"] < sent[1][1]["rid"]
    # One request, its reply taken in and decoded, the pool imported on first use (its FD fetched
    # on the control socket: a step, seen whole), the arrays.
    assert [e if e != "client.phase" else f"{i['phase']} {i['at']}" for e, i in reader] == [
        "client.wait", "client.received", "client.decoded", "client.pool_import", "control start", "control end",
        "client.pool_imported", "client.views"]
    reader = [(e, i) for e, i in reader if e != "client.phase"]
    rid, reply = reader[0][1]["rid"], reader[2][1]["msg"]
    assert reply["id"] == rid and reply["ok"] and reader[1][1]["nbytes"] > 0
    assert reader[3][1] == reader[4][1] == {"pool": "default"} and reader[5][1] == {"count": 1, "kind": "numpy"}


def test_the_broker_subscribes_the_callback_its_environment_names(start_broker, tmp_path):
    events = tmp_path / "events.jsonl"
    b = start_broker(env=broker_env("record", events))
    _write(b.socket_dir, "t/1")
    assert _read(b.socket_dir, "t/1") == b"seal"
    got = [(e, i) for e, i in read(events) if i.get("op") in ("create", "seal", "get_many") or e == "broker.entry"]
    assert [(e, i.get("op")) for e, i in got] == [
        ("broker.request", "create"), ("broker.entry", None), ("broker.handled", "create"), ("broker.reply", "create"),
        ("broker.request", "seal"), ("broker.handled", "seal"), ("broker.reply", "seal"),
        ("broker.request", "get_many"), ("broker.handled", "get_many"), ("broker.reply", "get_many")]
    assert got[1][1] == {"pool": "default", "name": "t/1", "index": got[1][1]["index"]}
    assert "name" in got[0][1]["fields"] and "alloc" in got[-1][1]["reply"]
    assert got[0][1]["sid"] == got[4][1]["sid"] != got[7][1]["sid"]   # the writer's session, then the reader's


def test_a_subscriber_that_raises_fails_nothing_it_traces(start_broker):
    b = start_broker(env=broker_env("fail"))
    calls = []

    def broken(event, info):
        calls.append(event)
        raise RuntimeError("a diagnostic's own bug")

    trace.set_trace(broken)
    try:
        _write(b.socket_dir, "t/1")   # in this process: dropped at its first event
        assert trace.hook is None and len(calls) == 1
    finally:
        trace.set_trace(None)
    assert _read(b.socket_dir, "t/1") == b"seal"
    deadline = time.monotonic() + 10
    while "is unsubscribed" not in b.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.log().count("the trace callback") == 1 and "RuntimeError: a diagnostic's own bug" in b.log()
    with ipcpool.connect(b.socket_dir) as c:
        assert c.stats()["objects"] >= 1


def test_a_broker_told_to_load_a_callback_that_is_not_there_does_not_start(tmp_path):
    env = {**os.environ, **broker_env("missing")}
    out = ipcpool_cmd("broker", "--socket-dir", str(tmp_path / "s"), "--backend", "host", env=env, timeout=60)
    assert out.returncode == 2
    assert "IPCPOOL_TRACE='tests.support.tracing:missing': cannot load the trace callback" in out.stderr
