"""How a client cuts the names of a ``get_many`` into requests (``leases._batches``): the usual
attach, every name within one request by a bound summed without encoding a name, must come out
as counting each name's bytes would cut it, and every request within the protocol's limits. (A
real broker answers batched requests in tests/integration/test_objects.py.)"""

from __future__ import annotations

import pytest

from ipcpool import protocol
from ipcpool._client.leases import _batches, _counted_batches

CASES = {
    "the usual attach": [f"weights/layer{i:04d}" for i in range(1024)],
    "one name past a batch": [f"w/{i:05d}" for i in range(protocol.MAX_BATCH + 1)],
    "several batches": [f"w/{i:05d}" for i in range(2500)],
    "3-byte characters, one request by bytes but not by the bound": ["€" * 60 + f"{i:03d}" for i in range(300)],
    "4-byte characters past a request's bytes": ["𝄞" * 50 + f"{i:03d}" for i in range(400)],
    "long names past a request's bytes": [f"{i:03d}" + "x" * 200 for i in range(400)],
    "not all names": ["a", 7, "b"],
    "one": ["only"],
    "none": [],
}


@pytest.mark.parametrize("names", CASES.values(), ids=CASES.keys())
def test_names_are_cut_as_counting_their_bytes_cuts_them(names):
    assert _batches(names) == _counted_batches(names)


@pytest.mark.parametrize("names", [n for n in CASES.values() if all(isinstance(x, str) for x in n)],
                         ids=[k for k, n in CASES.items() if all(isinstance(x, str) for x in n)])
def test_every_request_is_within_the_protocols_limits_and_keeps_the_names_in_order(names):
    batches = _batches(names)
    assert [n for b in batches for n in b] == names
    for batch in batches:
        assert 0 < len(batch) <= protocol.MAX_BATCH
        assert len(protocol.pack({"op": "get_many", "id": 1 << 40, "names": batch})) <= protocol.MAX_MESSAGE


def test_the_usual_attach_is_one_request_without_a_name_encoded():
    class Unencodable(str):
        def encode(self, *args, **kwargs):
            raise AssertionError("a name was encoded")

    names = [Unencodable(f"w/{i:05d}") for i in range(1024)]
    assert _batches(names) == [names]
