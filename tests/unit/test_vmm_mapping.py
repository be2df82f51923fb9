"""How a client's ``vmm.Mapping`` lays chunks out, with the driver replaced by a model of its
address reservations and mappings (the bookkeeping, not the GPU, is under test): one access call
per batch, the fast and slow paths, a chunk that straddles two reservations, a failed batch."""

import os

import pytest

cu_real = pytest.importorskip("cuda.bindings.driver")

from ipcpool.backend.cuda import vmm  # noqa: E402
from ipcpool.errors import IpcPoolError  # noqa: E402

MiB = 1 << 20
G = 2 * MiB
OK = cu_real.CUresult.CUDA_SUCCESS
BAD = cu_real.CUresult.CUDA_ERROR_INVALID_VALUE


class ModelDriver:
    """Reservations, mappings and access calls, as the driver keeps them. ``straddle``: may one
    mapping cross from one reservation into the next (the documentation does not say)."""

    def __init__(self, straddle: bool, taken=()):
        self.straddle = straddle
        self.ranges: dict[int, int] = {}
        self.maps: dict[int, int] = {}
        self.access: list[tuple[int, int, list[int]]] = []
        self.released: list[int] = []
        self.taken = list(taken)   # (address, length) someone else holds
        self.next_base = 1 << 40
        self.next_handle = 100
        self.fail_map_at: int | None = None   # the n-th cuMemMap fails (out of memory)
        self.map_calls = 0

    def __getattr__(self, name):   # structs and enums: the real ones
        return getattr(cu_real, name)

    def _free(self, a, n):
        spans = list(self.ranges.items()) + self.taken
        return all(a + n <= b or b + m <= a for b, m in spans)

    def cuMemAddressReserve(self, length, align, addr, flags):
        if addr and self._free(addr, length):
            self.ranges[addr] = length
            return OK, cu_real.CUdeviceptr(addr)
        base = self.next_base
        self.next_base += 1 << 36
        self.ranges[base] = length
        return OK, cu_real.CUdeviceptr(base)

    def cuMemAddressFree(self, ptr, length):
        assert self.ranges.pop(int(ptr)) == length
        return (OK,)

    def _reservation(self, a):
        return next(((b, n) for b, n in self.ranges.items() if b <= a < b + n), None)

    def cuMemMap(self, at, size, offset, handle, flags):
        self.map_calls += 1
        if self.map_calls == self.fail_map_at:
            return (cu_real.CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        first, last = self._reservation(at), self._reservation(at + size - 1)
        if first is None or last is None or (first != last and not self.straddle):
            return (BAD,)
        if any(at < b + n and b < at + size for b, n in self.maps.items()):
            return (BAD,)
        self.maps[at] = size
        return (OK,)

    def cuMemSetAccess(self, ptr, size, descs, count):
        a = ptr
        while a < ptr + size:   # every byte mapped, by whole mappings
            n = self.maps.get(a)
            if n is None:
                return (BAD,)
            a += n
        assert a == ptr + size and count == len(descs)
        self.access.append((ptr, size, [int(d.location.id) for d in descs]))
        return (OK,)

    def cuMemUnmap(self, at, size):
        assert self.maps.pop(at) == size
        return (OK,)

    def cuMemImportFromShareableHandle(self, fd, kind):
        self.next_handle += 1
        return OK, cu_real.CUmemGenericAllocationHandle(self.next_handle)

    def cuMemRelease(self, handle):
        self.released.append(int(handle))
        return (OK,)


@pytest.fixture
def driver(monkeypatch):
    def use(straddle=False, taken=()):
        model = ModelDriver(straddle, taken)
        monkeypatch.setattr(vmm, "cu", model)
        return model
    return use


def fds(n):
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]


def test_a_batch_of_chunks_is_granted_access_in_one_call_for_every_device(driver):
    d = driver()
    m = vmm.Mapping(0, G, headroom=2, peers=(1,))
    assert m.extend([G] * 5, fds(5)) is False
    assert d.map_calls == 5 and d.access == [(m.ptr, 5 * G, [0, 1])]
    assert m.size == 5 * G and m.reserved == 10 * G
    m.extend([G] * 3, fds(3))                          # in the reservation: in place, one call
    assert len(d.access) == 2 and d.access[1] == (m.ptr + 5 * G, 3 * G, [0, 1])


def test_growth_past_the_reservation_stays_in_place_where_the_next_range_is_free(driver):
    d = driver()
    m = vmm.Mapping(0, G, headroom=2)
    m.extend([G], fds(1))
    ptr = m.ptr
    assert m.extend([G], fds(1)) is False and m.ptr == ptr   # fills the reservation exactly
    assert m.extend([2 * G], fds(1)) is False and m.ptr == ptr and len(d.ranges) == 2
    assert m.size == 4 * G


def test_a_chunk_straddling_two_reservations_is_remapped_where_the_driver_refuses_it(driver):
    d = driver(straddle=False)
    m = vmm.Mapping(0, G, headroom=2)
    m.extend([G], fds(1))                                  # 1 of 2 granules reserved mapped
    old = m.ptr
    assert m.extend([4 * G], fds(1)) is True               # it would cross old + 2G
    assert m.ptr != old and m.size == 5 * G
    assert d.maps[m.ptr] == G and d.maps[m.ptr + G] == 4 * G   # every chunk at the new range
    assert d.access[-1] == (m.ptr, 5 * G, [0])                  # in one access call
    m.close()
    assert d.maps == {} and d.ranges == {} and sorted(d.released) == [101, 102]


def test_a_chunk_straddling_two_reservations_stays_in_place_where_the_driver_allows_it(driver):
    d = driver(straddle=True)
    m = vmm.Mapping(0, G, headroom=2)
    m.extend([G], fds(1))
    old = m.ptr
    assert m.extend([4 * G], fds(1)) is False and m.ptr == old and m.size == 5 * G
    assert d.access[-1] == (old + G, 4 * G, [0])


def test_the_slow_path_where_the_next_range_is_taken(driver):
    d = driver()
    m = vmm.Mapping(0, G, headroom=2)
    m.extend([2 * G], fds(1))
    d.taken.append((m.ptr + m.reserved, 1 << 30))
    old = m.ptr
    assert m.extend([G, G, G], fds(3)) is True and m.ptr != old and m.size == 5 * G
    assert d.access[-1] == (m.ptr, 5 * G, [0])
    assert d.maps[old] == 2 * G                            # the old range stays until close
    m.close()
    assert d.maps == {} and d.ranges == {} and sorted(d.released) == [101, 102, 103, 104]


def test_a_batch_that_fails_leaves_nothing_mapped_and_releases_its_imports(driver):
    d = driver()
    m = vmm.Mapping(0, G, headroom=4)
    m.extend([G], fds(1))
    d.fail_map_at = d.map_calls + 2                        # the second chunk of the next batch
    with pytest.raises(IpcPoolError):
        m.extend([G, G, G], fds(3))
    assert m.size == G and list(d.maps) == [m.ptr] and sorted(d.released) == [102, 103, 104]
    assert m.extend([G, G], fds(2)) is False and m.size == 3 * G   # and it still grows
    m.close()
    assert d.maps == {} and sorted(d.released) == [101, 102, 103, 104, 105, 106]
