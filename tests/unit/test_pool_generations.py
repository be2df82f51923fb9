"""Re-adopting pools that come back read-only (as CUDA pools do): the registry's naming of the old
generations, where stored objects land, and the release of a generation once it holds nothing.
Real memfd pools stand in for the CUDA ones; only ``read_only`` differs."""

import os

from ipcpool.backend.base import PoolSpec
from ipcpool.backend.host import HostBrokerBackend, HostPool
from ipcpool.broker.durable import Durability
from ipcpool.broker.registry import Registry
from ipcpool.broker.systemd import Notifier
from ipcpool.config import Config

MiB = 1 << 20


class ReadOnlyHostPool(HostPool):
    read_only = True


class AdoptsReadOnly(HostBrokerBackend):
    """Like the CUDA backend: a stored pool comes back unable to allocate."""

    def adopt_pool(self, spec, fd, info):
        return ReadOnlyHostPool(spec, fd)


def stored_pool(size: int) -> int:
    fd = os.memfd_create("stored", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def registry_with(inherited: dict[str, int]) -> tuple[Registry, Durability]:
    config = Config(pools=(PoolSpec("default", max_size=16 * MiB),))
    durable = Durability(Notifier({}), inherited)
    reg = Registry(config, AdoptsReadOnly())
    reg.create_pools(durable)
    return reg, durable


def test_a_read_only_pool_is_renamed_beside_a_fresh_one_after_older_generations():
    reg, durable = registry_with({"pool-default": stored_pool(16 * MiB), "pool-default~1": stored_pool(16 * MiB)})
    assert sorted(reg.pools) == ["default", "default~1", "default~2"]
    assert reg.pools["default~1"].read_only and reg.pools["default~2"].read_only
    assert not reg.pools["default"].read_only               # new memory comes from here
    assert reg.renamed == {"default": "default~2"}
    assert sorted(durable._taken) == ["pool-default", "pool-default~1"]   # removed, then stored anew
    # A stored object recorded under "default" is found in the generation that now holds it;
    # one recorded under an old generation's name stays there.
    a = reg.restore({"pool": "default", "offset": 0, "size": MiB}, [])
    b = reg.restore({"pool": "default~1", "offset": MiB, "size": MiB}, [])
    assert a.pool is reg.pools["default~2"] and b.pool is reg.pools["default~1"]
    reg.close()
    durable.close()


def test_a_generation_goes_once_its_last_restored_allocation_is_freed():
    reg, durable = registry_with({"pool-default": stored_pool(16 * MiB), "pool-default~1": stored_pool(16 * MiB)})
    emptied = []
    reg.on_pool_emptied = emptied.append
    keep = reg.restore({"pool": "default", "offset": 0, "size": MiB}, [])
    reg.drop_empty_generations()                             # default~1 held nothing restored
    assert sorted(reg.pools) == ["default", "default~2"] and [p.spec.name for p in emptied] == ["default~1"]
    reg.hold(keep, "object")
    reg.unhold(keep, "object", b"", None)                    # its last holder lets go
    assert sorted(reg.pools) == ["default"] and reg.renamed == {}
    assert [p.spec.name for p in emptied] == ["default~1", "default~2"]
    reg.close()
    durable.close()
