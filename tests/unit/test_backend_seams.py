"""The broker's backend seam stays narrow: a pool is memory only, and ordering (events, credits,
done waits), carving and usage are seams of their own, reached through it."""

from ipcpool.backend.base import NO_ARENAS, Arenas, BrokerPool, PoolSpec, Usage
from ipcpool.backend.host import HostBrokerBackend
from ipcpool.backend.ordering import NULL_ORDERING, NullOrdering, Ordering

MEMORY = {"spec", "read_only", "ordering", "arenas", "usage", "fd", "pool_info", "allocate", "free",
          "chunk_fds", "restore", "close"}


def members(cls: type) -> set[str]:
    """Methods, properties and class attributes ``cls`` itself defines (declared ones included)."""
    names = {n for n in vars(cls) if not n.startswith("__") and n != "_abc_impl"}
    return names | set(vars(cls).get("__annotations__", {}))


def test_a_broker_pool_keeps_memory_only():
    assert members(BrokerPool) == MEMORY and len(MEMORY) <= 12
    # Each concept's hooks are its own; a pool implementing one is that concept's accessor too.
    assert members(BrokerPool) & (members(Ordering) | members(Arenas) | members(Usage)) == {"arenas", "usage"}


def test_the_host_orders_nothing_and_serves_its_arenas_and_usage_itself():
    backend = HostBrokerBackend()
    pool = backend.create_pool(PoolSpec("p", max_size=1 << 20))
    try:
        assert isinstance(pool.ordering, NullOrdering) and pool.ordering is NULL_ORDERING
        assert pool.arenas is pool and pool.usage is pool and pool.arenas is not NO_ARENAS
        session = backend.open_session()
        handle, export = pool.allocate(4096, session)
        assert pool.ordering.reexport(handle, export, session) is export
        assert pool.ordering.seal(handle, session, b"") == b"" and pool.ordering.seal_done(handle)
        assert pool.ordering.credit(session) == b"" and pool.ordering.renew(handle)
        pool.free(handle, session)
        assert pool.usage.stats().used == 0
    finally:
        pool.close()
        backend.close()
