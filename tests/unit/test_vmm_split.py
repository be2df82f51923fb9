"""How memory above the import limit and growth are cut into VMM chunks (pure arithmetic)."""

import pytest

from ipcpool.backend.cuda.vmm import round_up, split

MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize(
    "nbytes, want",
    [
        (8 * GiB, [2 * GiB] * 4),
        (4 * GiB + 1, [2 * GiB, 2 * GiB, 2 * MiB]),         # the byte over costs one granule
        (3 * MiB, [4 * MiB]),
        (2 * GiB, [2 * GiB]),
    ],
)
def test_chunks_cover_the_request_in_granules_and_none_exceeds_the_cap(nbytes, want):
    got = split(nbytes, 2 * MiB, 2 * GiB)
    assert got == want
    assert sum(got) == round_up(nbytes, 2 * MiB) and all(c % (2 * MiB) == 0 and c <= 2 * GiB for c in got)


def test_a_cap_below_the_granularity_still_gives_whole_granules():
    assert split(5 * MiB, 2 * MiB, MiB) == [2 * MiB] * 3
