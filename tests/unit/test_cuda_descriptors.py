"""Pointer export data and IPC event handles as wire bytes: bytes -> driver struct -> bytes gives
the same 64 bytes back on both sides (no GPU needed: the structs are plain memory)."""

import os

import pytest

from ipcpool.errors import InvalidRequest

descriptors = pytest.importorskip("ipcpool.backend.cuda.descriptors", exc_type=ImportError)
cu = pytest.importorskip("cuda.bindings.driver")

KINDS = [cu.CUmemPoolPtrExportData, cu.CUipcEventHandle]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_wire_bytes_survive_a_struct_round_trip(kind):
    samples = [os.urandom(64), bytes(64), bytes([0xFF]) * 64, bytes(range(64))]
    structs = [descriptors._struct(kind, data, "x") for data in samples]   # all alive at once
    assert [descriptors._bytes(s) for s in structs] == samples
    assert len({s.getPtr() for s in structs}) == len(structs)   # each holds its own 64 bytes
    # what the importer builds reads back as what the exporter sent, also from a memoryview
    assert descriptors._bytes(descriptors._struct(kind, memoryview(samples[0]), "x")) == samples[0]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("size", [0, 63, 65, 128])
def test_only_64_bytes_make_a_struct(kind, size):
    with pytest.raises(InvalidRequest, match="64 bytes"):
        descriptors._struct(kind, bytes(size), "an IPC event handle")
