"""Where a version's tensors lie (``weights.layout.plan``), and the manifest checks of the protocol."""

import pytest

from ipcpool import protocol
from ipcpool.errors import InvalidRequest, ProtocolError
from ipcpool.weights.layout import ALIGN, TensorSpec, plan


def test_tensors_are_packed_in_order_at_aligned_offsets():
    specs = [TensorSpec("a", "float32", (3,)), TensorSpec("b", "bfloat16", (5, 7)), TensorSpec("c", "int8", ())]
    shards, entries = plan(specs, shard_bytes=1 << 20)
    assert shards == [2 * ALIGN + 1]
    assert [(e.name, e.shard, e.offset, e.nbytes) for e in entries] == [("a", 0, 0, 12), ("b", 0, ALIGN, 70),
                                                                        ("c", 0, 2 * ALIGN, 1)]


def test_shards_are_cut_at_shard_bytes_and_a_large_tensor_gets_its_own():
    specs = [TensorSpec(f"t{i}", "uint8", (400,)) for i in range(5)] + [TensorSpec("big", "uint8", (5000,))]
    shards, entries = plan(specs, shard_bytes=1024)
    assert [e.shard for e in entries] == [0, 0, 1, 1, 2, 3]
    assert shards == [ALIGN * 2 + 400, ALIGN * 2 + 400, 400, 5000]
    assert all(e.offset % ALIGN == 0 for e in entries)


def test_an_empty_version_still_has_one_shard_and_bad_dtypes_are_refused():
    assert plan([]) == ([1], [])
    with pytest.raises(InvalidRequest, match="dtype 'float128' is not one of"):
        plan([TensorSpec("x", "float128", (1,))])


def test_the_protocol_checks_every_manifest_field():
    ok = {"op": "ckpt_add", "id": 1, "name": "m", "version": 1, "entries": [["a", "float32", [2, 2], 0, 0, 16]]}
    assert protocol.validate(ok, protocol.REQUESTS)[0] == "ckpt_add"
    for entry, message in [(["a", "float32", [2, 2], 0, 0, 15], "not 15 bytes"),
                           (["a", "float32", [2, True], 0, 0, 8], "non-negative ints"),
                           (["a", "float32", [2], -1, 0, 8], "non-negative ints"),
                           (["a\n", "float32", [2], 0, 0, 8], "printable"),
                           (["a", "float32", [1 << 40, 1 << 40, 1 << 40], 0, 0, 8], "not 8 bytes")]:
        with pytest.raises(InvalidRequest, match=message):
            protocol.validate({**ok, "entries": [entry]}, protocol.REQUESTS)
    with pytest.raises(ProtocolError, match="longer than 1024"):
        protocol.validate({**ok, "entries": [["a", "uint8", [1], 0, 0, 1]] * 1025}, protocol.REQUESTS)
    with pytest.raises(InvalidRequest, match="an event handle is bytes"):
        protocol.validate({"op": "ckpt_publish", "id": 1, "name": "m", "version": 1, "done_events": ["x"]},
                          protocol.REQUESTS)
