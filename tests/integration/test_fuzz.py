"""A seeded fuzz of both sockets (tests/fuzz/fuzz_broker.py, small): the broker serves after every
batch, never answers with an internal error, never says ``ok`` to a malformed request, and every
reply is one a client can decode."""

from tests.fuzz.fuzz_broker import MALFORMED, fuzz


def test_seeded_fuzz_of_both_sockets(broker):
    summary = fuzz(broker.socket_dir, seed=20261123, zmq_frames=20000, control_frames=2000, batch=200,
                   broker_pid=broker.pid)
    d = summary.as_dict()
    assert summary.zmq_frames == 20000 and summary.control_frames >= 2000
    assert d["internal_errors"] == 0, d["internal_errors_examples"]
    assert d["ok_to_malformed"] == 0, d["ok_to_malformed_examples"]
    assert d["undecodable"] == 0, d["undecodable_examples"]
    assert summary.alive_checks == summary.batches >= 40
    assert MALFORMED | {"oversized"} <= set(summary.by_kind)   # every kind of malformed frame was sent
    assert summary.error_replies > 10000 and summary.ok_to_valid > 100   # valid ones still work
    assert broker.proc.poll() is None
    assert "Traceback" not in broker.log()
