"""The stock of chunks growable buffers take from: its sizes, take, refill, shed, and how a CUDA
growable uses it (driver calls replaced by fakes: the bookkeeping, not the GPU, is under test)."""

import contextlib

import pytest

from ipcpool.backend.stock import ChunkStock, stock_sizes
from ipcpool.errors import OutOfMemory

MiB, GiB = 1 << 20, 1 << 30


class FakeChunk:
    def __init__(self, size, compression=False, log=None):
        self.size, self.compression, self.closed, self._log = size, compression, False, log

    def close(self):
        assert not self.closed
        self.closed = True
        if self._log is not None:
            self._log.append(self.size)


def new_stock(target=GiB, gran=2 * MiB, largest=2 * GiB, released=None, fail=False):
    made = []

    def make(size):
        if fail:
            raise OutOfMemory("the device is full")
        made.append(size)
        return FakeChunk(size, log=released)

    stock = ChunkStock(target, gran, make, largest)
    stock.made = made
    return stock


def fill(stock, room=1 << 60):
    while stock.refill_one(room):
        pass


def test_sizes_are_powers_of_two_granules_one_each_within_the_target():
    assert stock_sizes(GiB, 2 * MiB, 2 * GiB) == [s * MiB for s in (512, 256, 128, 64, 32, 16, 8, 4, 2)]
    assert sum(stock_sizes(GiB, 2 * MiB, 2 * GiB)) == 1022 * MiB
    assert stock_sizes(64 * MiB, 2 * MiB, 8 * MiB) == [8 * MiB, 4 * MiB, 2 * MiB]   # capped per chunk
    assert stock_sizes(MiB, 2 * MiB, 2 * GiB) == [] and stock_sizes(0, 2 * MiB, GiB) == []


def test_refill_makes_the_largest_missing_chunk_first_and_counts_it():
    stock = new_stock(target=14 * MiB)
    assert stock.bytes == 0 and stock.wanted(1 << 60) == 8 * MiB
    assert stock.refill_one(1 << 60) and stock.bytes == 8 * MiB
    assert stock.wanted(3 * MiB) == 2 * MiB                   # only what fits the room
    fill(stock)
    assert stock.made == [8 * MiB, 4 * MiB, 2 * MiB] and stock.bytes == 14 * MiB
    assert not stock.refill_one(1 << 60) and stock.wanted(1 << 60) is None   # full


def test_a_refill_capped_in_size_makes_only_the_small_chunks():
    # What the broker does right after a grow's answer: a small chunk now, big ones when quiet.
    stock = new_stock(target=14 * MiB)
    assert stock.wanted(1 << 60, most=4 * MiB) == 4 * MiB
    assert stock.refill_one(1 << 60, most=4 * MiB) and stock.refill_one(1 << 60, most=4 * MiB)
    assert not stock.refill_one(1 << 60, most=4 * MiB) and stock.made == [4 * MiB, 2 * MiB]
    assert stock.wanted(1 << 60) == 8 * MiB                   # left for the idle pass
    assert stock.wanted(1 << 60, most=MiB) is None            # smaller than any size: none


def test_a_doubling_buffer_takes_one_stocked_chunk_per_step_and_exactly_its_size():
    stock = new_stock()
    fill(stock)
    assert stock.bytes == GiB                 # 2, 4, ..., 512 MiB, and 2 MiB again
    assert [c.size for c in stock.take(2 * MiB)[0]] == [2 * MiB]   # the create
    size = 2 * MiB
    while size < GiB:
        taken, lacking = stock.take(size)   # doubling: the step adds the current size
        assert [c.size for c in taken] == [size] and lacking == 0
        size *= 2
    assert stock.bytes == 0
    assert new_stock(target=14 * MiB).sizes == [8 * MiB, 4 * MiB, 2 * MiB]
    fill(small := new_stock(target=14 * MiB))
    assert small.bytes == 14 * MiB            # no room for a second 2 MiB chunk


def test_a_stock_capped_by_the_largest_chunk_fills_its_target_with_more_of_them():
    stock = new_stock(target=8 * GiB, largest=2 * GiB)
    fill(stock)
    assert stock.bytes == 8 * GiB and stock.made.count(2 * GiB) == 3 and stock.made.count(2 * MiB) == 2
    taken, lacking = stock.take(4 * GiB)      # the last step of a doubling to 8 GiB
    assert [c.size for c in taken] == [2 * GiB, 2 * GiB] and lacking == 0
    assert stock.wanted(1 << 60) == 2 * GiB
    fill(capped := new_stock(target=GiB + 100 * MiB, largest=2 * GiB))
    assert capped.bytes == 1024 * MiB         # not capped by the chunk: the rest stays unused


def test_take_is_largest_first_while_it_fits_and_says_what_is_lacking():
    stock = new_stock(target=14 * MiB)
    fill(stock)
    taken, lacking = stock.take(3 * MiB)                      # rounded up to 4 MiB, never more
    assert [c.size for c in taken] == [4 * MiB] and lacking == 0 and stock.bytes == 10 * MiB
    taken, lacking = stock.take(20 * MiB)
    assert [c.size for c in taken] == [8 * MiB, 2 * MiB] and lacking == 10 * MiB and stock.bytes == 0
    stock.give_back(taken)                                    # a grow that failed
    assert stock.bytes == 10 * MiB and stock.wanted(1 << 60) == 4 * MiB


def test_held_counts_what_can_be_taken_or_lent_and_an_empty_stock_lends_nothing():
    stock = new_stock(target=14 * MiB)
    fill(stock)
    assert stock.held == stock.bytes == 14 * MiB
    taken, _ = stock.take(4 * MiB)
    lent = stock.lend(1 << 60, 16)
    assert sorted(c.size for c in lent) == [2 * MiB, 8 * MiB]
    assert stock.held == 0 and stock.bytes == 10 * MiB           # lent: still the stock's, not held
    assert stock.lend(1 << 60, 16) == [] and stock.take(2 * MiB) == ([], 2 * MiB)
    stock.give_back(taken)
    assert stock.held == 4 * MiB and stock.shed(1 << 60) == 0    # it fits: nothing released
    stock.lent_back(lent)
    assert stock.held == stock.bytes == 4 * MiB
    assert stock.shed(0) == 4 * MiB and stock.held == stock.bytes == 0


def test_shed_yields_room_smallest_first_and_close_releases_everything():
    released = []
    stock = new_stock(target=14 * MiB, released=released)
    fill(stock)
    assert stock.shed(9 * MiB) == 6 * MiB and released == [2 * MiB, 4 * MiB] and stock.bytes == 8 * MiB
    stock.close()
    assert released == [2 * MiB, 4 * MiB, 8 * MiB] and stock.bytes == 0


def test_a_failed_refill_leaves_the_stock_as_it_was():
    stock = new_stock(fail=True)
    with pytest.raises(OutOfMemory):
        stock.refill_one(1 << 60)
    assert stock.bytes == 0 and stock.wanted(1 << 60) == 512 * MiB


# -- a CUDA growable with a stock, its driver calls faked ----------------------------------------
@pytest.fixture
def cuda_growable(monkeypatch):
    from ipcpool.backend.cuda import growable, vmm

    created = []

    def create_chunks(device, sizes, compression):
        created.extend(sizes)
        return [FakeChunk(s, compression) for s in sizes]

    monkeypatch.setattr(growable, "OnDevice", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(vmm, "check_supported", lambda device: None)
    monkeypatch.setattr(vmm, "compression_supported", lambda device: True)
    monkeypatch.setattr(vmm, "granularity", lambda device, compression=False: 2 * MiB)
    monkeypatch.setattr(vmm, "create_chunks", create_chunks)
    return growable.CudaGrowable, created


def test_a_cuda_grow_takes_stocked_chunks_and_makes_only_what_the_stock_lacks(cuda_growable):
    CudaGrowable, created = cuda_growable
    stock = new_stock(target=14 * MiB)
    fill(stock)
    g = CudaGrowable(0, False)
    g.grow(6 * MiB, stock)
    assert g.chunks == [4 * MiB, 2 * MiB] and created == [] and stock.bytes == 8 * MiB
    g.grow(32 * MiB, stock)                                   # 26 MiB more: the 8 MiB chunk, then made
    assert g.chunks == [4 * MiB, 2 * MiB, 8 * MiB, 18 * MiB] and created == [18 * MiB]
    assert g.size == 32 * MiB and stock.bytes == 0


def test_a_compressible_cuda_buffer_never_takes_plain_chunks(cuda_growable):
    CudaGrowable, created = cuda_growable
    stock = new_stock(target=14 * MiB)
    fill(stock)
    g = CudaGrowable(0, True)
    g.grow(8 * MiB, stock)
    assert created == [8 * MiB] and stock.bytes == 14 * MiB


def test_chunks_taken_for_a_cuda_grow_that_fails_go_back_to_the_stock(cuda_growable, monkeypatch):
    from ipcpool.backend.cuda import vmm

    CudaGrowable, _ = cuda_growable
    stock = new_stock(target=14 * MiB)
    fill(stock)

    def no_memory(device, sizes, compression):
        raise OutOfMemory("cuMemCreate failed")

    monkeypatch.setattr(vmm, "create_chunks", no_memory)
    g = CudaGrowable(0, False)
    with pytest.raises(OutOfMemory):
        g.grow(20 * MiB, stock)
    assert g.size == 0 and stock.bytes == 14 * MiB


# -- the broker's table: the stock per pool, its room under max_size, stats ---------------------
class StockGrowable:
    """A growable that takes from the stock first, as the CUDA one does (made chunks are fakes)."""

    one_file = False

    def __init__(self, nbytes, stock):
        self._chunks = []
        self.grow(nbytes, stock)

    chunks = property(lambda self: [c.size for c in self._chunks])
    size = property(lambda self: sum(self.chunks))

    def grow(self, nbytes, stock=None):
        taken, need = stock.take(nbytes - self.size) if stock else ([], nbytes - self.size)
        self._chunks += taken + ([FakeChunk(need)] if need > 0 else [])

    def takes_from(self, stock):
        return True

    def add(self, chunks):
        self._chunks += chunks

    def close(self):
        for c in self._chunks:
            c.close()


@pytest.fixture
def table():
    from ipcpool.backend.host.broker import HostBrokerBackend
    from ipcpool.backend.records import PoolSpec
    from ipcpool.broker.growables import GrowableTable
    from ipcpool.broker.registry import Registry
    from ipcpool.config import Config

    class StockingBackend(HostBrokerBackend):
        def chunk_stock(self, spec, target):
            return new_stock(target)

        def create_growable(self, spec, nbytes, compression, stock=None):
            return StockGrowable(nbytes, stock)

    registry = Registry(Config(pools=(PoolSpec("default", max_size=64 * MiB),)), StockingBackend())
    registry.create_pools()
    t = GrowableTable(registry)
    t.open_stocks(14 * MiB)
    yield t
    t.close_stocks()
    registry.close()


class FakeSession:
    def __init__(self, uid=1000):
        self.cred = type("Cred", (), {"uid": uid})()


def test_the_table_fills_the_stock_at_start_grows_from_it_and_refills_while_idle(table):
    stock = table.stocks["default"]
    assert stock.bytes == 14 * MiB and table.stats()["default"]["stock_bytes"] == 14 * MiB
    assert not table.stock_wanted()
    s = FakeSession()
    g = table.create(s, "g", 6 * MiB, "default", False)
    assert g.memory.chunks == [4 * MiB, 2 * MiB] and stock.bytes == 8 * MiB
    assert table.stats()["default"] == {"growables": 1, "growable_bytes": 6 * MiB, "stock_bytes": 8 * MiB,
                                        "lent_bytes": 0}
    assert table.stock_wanted()                                   # the idle pass makes them again
    while table.refill_stock():
        pass
    assert stock.bytes == 14 * MiB and not table.stock_wanted()


def test_the_stock_counts_against_max_size_and_yields_to_buffers(table):
    from ipcpool.errors import OutOfMemory

    stock, s = table.stocks["default"], FakeSession()
    g = table.create(s, "g", 6 * MiB, "default", False)
    table.grow(s, "g", 60 * MiB)                                  # uses the room the stock held
    assert g.memory.size == 60 * MiB and stock.bytes <= 4 * MiB   # the stock shed what no longer fits
    while table.refill_stock():
        pass
    assert g.memory.size + stock.bytes <= 64 * MiB and stock.bytes == 4 * MiB
    with pytest.raises(OutOfMemory, match="max_size"):
        table.grow(s, "g", 66 * MiB)
    table.delete("g")
    table.detach(s, "g")                                          # destroyed: room came back
    assert table.stock_wanted()
    while table.refill_stock():
        pass
    assert stock.bytes == 14 * MiB


def test_a_pool_whose_device_cannot_stock_chunks_starts_without_a_stock():
    from ipcpool.backend.host.broker import HostBrokerBackend
    from ipcpool.broker.growables import GrowableTable
    from ipcpool.broker.registry import Registry
    from ipcpool.config import Config
    from ipcpool.errors import BackendUnavailable

    class NoVmm(HostBrokerBackend):
        def chunk_stock(self, spec, target):
            raise BackendUnavailable("CUDA device 0 has no virtual memory management")

    registry = Registry(Config(), NoVmm())
    registry.create_pools()
    t = GrowableTable(registry)
    t.open_stocks(256 * MiB)
    assert t.stocks == {} and not t.stock_wanted() and "stock_bytes" not in str(t.stats())
    registry.close()


# -- chunks lent to the sessions that grow (broker.loans) ----------------------------------------
def test_a_loan_is_the_stocks_held_chunks_and_never_made_twice(table):
    stock, s = table.stocks["default"], FakeSession()
    g = table.create(s, "g", 2 * MiB, "default", False)            # takes the 2 MiB chunk
    lent = table.lend(s, g, 16)
    assert sorted(c.size for _, c in lent) == [4 * MiB, 8 * MiB]   # all it held, smallest first
    table.refill_quick()                                          # a loan went out: none made at once
    assert stock.made.count(2 * MiB) == 1
    assert table.registry.bytes_by_uid[1000] == 2 * MiB            # the buffer's: a loan is the stock's
    assert stock.bytes == 12 * MiB and table.stats()["default"]["lent_bytes"] == 12 * MiB
    while table.refill_stock():                                   # only the 2 MiB taken is made again
        pass
    assert stock.made.count(4 * MiB) == 1 and stock.bytes == 14 * MiB
    assert table.lend(FakeSession(1001), g, 16) == []                # another uid: its buffer, not its loan


def test_a_grow_takes_the_loaned_chunks_it_names_only_where_they_are_the_step_and_the_buffer_unchanged(table):
    s = FakeSession()
    g = table.create(s, "g", 2 * MiB, "default", False)
    ids = {c.size: (lid, c) for lid, c in table.lend(s, g, 16)}
    four, eight = ids[4 * MiB], ids[8 * MiB]
    # the wrong size for the step, a chunk not lent, and a stale ``first``: grown as without a loan
    assert table.grow(s, "g", 4 * MiB, [four[0]], 1)[2] is False and g.memory.size == 4 * MiB
    assert table.grow(s, "g", 8 * MiB, [999], 2)[2] is False and g.memory.size == 8 * MiB
    assert table.grow(s, "g", 12 * MiB, [four[0]], 1)[2] is False and g.memory.size == 12 * MiB
    assert table.registry.bytes_by_uid[1000] == 12 * MiB
    n = len(g.memory.chunks)
    _, others, took = table.grow(s, "g", 24 * MiB, [eight[0], four[0]], n)
    assert took and g.memory._chunks[n:] == [eight[1], four[1]] and g.memory.size == 24 * MiB
    assert table.registry.bytes_by_uid[1000] == 24 * MiB           # charged as any grow
    assert table.stats()["default"]["lent_bytes"] == 0 and g.gen == 4
    assert table.grow(s, "g", 36 * MiB, [four[0]], n + 2)[2] is False   # taken once only


def test_a_loan_ends_with_the_last_buffer_of_its_pool_or_the_session_and_its_chunks_are_released(table):
    released = []
    stock, s = table.stocks["default"], FakeSession()
    g = table.create(s, "g", 2 * MiB, "default", False)
    table.create(s, "h", 2 * MiB, "default", False)
    for _, c in table.lend(s, g, 16):
        c._log = released
    table.detach(s, "g")                                          # "h" is still held: the loan stays
    assert released == [] and table.stats()["default"]["lent_bytes"] == 12 * MiB
    table.detach(s, "h")
    assert sorted(released) == [4 * MiB, 8 * MiB] and table.stats()["default"]["lent_bytes"] == 0
    assert table.registry.bytes_by_uid[1000] == 4 * MiB and stock.bytes == 0   # the two buffers only
    assert table.stock_wanted()                                   # the sizes are made again, new
    t = FakeSession(uid=1001)
    table.attach(t, "g")
    other = table.create(t, "x", 2 * MiB, "default", False)
    while table.refill_stock():
        pass
    assert table.lend(t, other, 16)
    table.end_session(t)
    assert table.stats()["default"]["lent_bytes"] == 0 and table.registry.bytes_by_uid[1001] == 2 * MiB


def test_a_loan_stays_within_the_borrowers_quota(table):
    from ipcpool.config import Quota

    table.registry.config.quotas[1000] = Quota(bytes=8 * MiB)
    s = FakeSession()
    g = table.create(s, "g", 2 * MiB, "default", False)
    assert [c.size for _, c in table.lend(s, g, 16)] == [4 * MiB]  # 6 of 8 MiB: the 8 MiB chunk waits
    assert table.registry.bytes_by_uid[1000] == 2 * MiB