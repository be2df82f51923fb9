import pytest

from ipcpool.config import ConfigError, load, parse


def test_defaults():
    cfg = parse({})
    assert [p.name for p in cfg.pools] == ["default"]
    assert cfg.allowed(0, 12345)
    import os
    assert cfg.allowed(os.getuid(), 0)
    assert not cfg.allowed(54321, 54321)


def test_full_config(tmp_path):
    f = tmp_path / "b.toml"
    f.write_text(
        'backend = "host"\nsocket_dir = "/run/x"\n'
        '[access]\nuids = [1000]\ngids = [27]\ngroups = ["root"]\n'
        '[[pools]]\nname = "weights"\nmax_size = "2G"\nrelease_threshold = "512MiB"\npeer_access = [1]\n'
        '[pools.reuse]\nallow_opportunistic = false\n'
        '[quotas.default]\nbytes = "1G"\n[quotas.1000]\nbytes = 4096\n'
    )
    cfg = load(f)
    (pool,) = cfg.pools
    assert pool.max_size == 2 << 30 and pool.release_threshold == 512 << 20
    assert pool.reuse["allow_opportunistic"] is False and pool.reuse["follow_event_dependencies"] is True
    assert pool.peer_access == (1,)
    assert pool.slab_memory == "pool"   # the default
    assert cfg.allowed(1000, 1) and cfg.allowed(5, 27) and cfg.allowed(5, 0)
    assert cfg.quota_for(1000).bytes == 4096 and cfg.quota_for(7).bytes == 1 << 30


@pytest.mark.parametrize(
    "text, key",
    [
        ('backend = "gpu"', "backend"),
        ('bogus = 1', "bogus"),
        ('[[pools]]\nname = "a b"', "pools[0].name"),
        ('[[pools]]\nname = "a"\nmax_size = "lots"', "pools[0].max_size"),
        ('[[pools]]\nname = "a"\nmax_size = -5', "pools[0].max_size"),
        ('[[pools]]\nname = "a"\n[pools.reuse]\nfast = true', "pools[0].reuse.fast"),
        ('[[pools]]\nname = "a"\n[[pools]]\nname = "a"', "duplicate"),
        ('[access]\ngroups = ["no-such-group-here"]', "access.groups[0]"),
        ('[access]\nuids = ["no-such-user-29"]', "access.uids[0]: no user named"),
        ('[quotas.no-such-user-29]\nbytes = 1', "quotas.no-such-user-29"),
        ('[quotas.default]\nobjects = -1', "quotas.default.objects"),
        ('[quotas.default]\nobjects = "many"', "quotas.default.objects"),
        ('pools = []', "pools"),
        ('busy_poll_us = -1', "busy_poll_us"),
        ('busy_poll_us = "fast"', "busy_poll_us"),
        ('busy_poll_parked_us = 100001', "busy_poll_parked_us: 0 to 100000"),
        ('busy_poll_parked_us = true', "busy_poll_parked_us"),
        ('[[pools]]\nname = "a"\nslab_memory = "hbm"', "pools[0].slab_memory: one of pool, vmm"),
        ('[[pools]]\nname = "a"\nslab_memory = 1', "pools[0].slab_memory"),
    ],
)
def test_bad_values_name_their_key(tmp_path, text, key):
    f = tmp_path / "b.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(f)
    assert key in str(info.value)


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[pools]\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(bad)


def test_supplementary_groups_grant_access():
    cfg = parse({"access": {"uids": [0], "gids": [27]}})
    assert cfg.allowed(1000, 1000, (4, 27)) and not cfg.allowed(1000, 1000, (4, 24))
    assert not cfg.allowed(1000, 1000)


def test_peer_groups_of_a_socketpair_are_ours():
    import os
    import socket

    from ipcpool import fdpass

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        assert sorted(fdpass.peer_groups(a)) == sorted(os.getgroups())


def test_growth_stock_is_a_size_per_pool_and_zero_turns_it_off():
    from ipcpool.errors import ConfigError

    assert parse({}).growth_stock == 256 << 20
    assert parse({"growth": {"stock": "1G"}}).growth_stock == 1 << 30
    assert parse({"growth": {"stock": 0}}).growth_stock == 0
    for bad, key in (({"stock": "lots"}, "growth.stock"), ({"stok": 1}, "growth"), ({"stock": -1}, "growth.stock")):
        with pytest.raises(ConfigError, match=key):
            parse({"growth": bad})


def test_growth_board_counts_buffers_and_zero_turns_it_off():
    from ipcpool.errors import ConfigError

    assert parse({}).growth_board == 4096
    assert parse({"growth": {"board": 2}}).growth_board == 2
    assert parse({"growth": {"board": 0}}).growth_board == 0
    for bad in ("many", -1, (1 << 20) + 1):
        with pytest.raises(ConfigError, match="growth.board"):
            parse({"growth": {"board": bad}})


def test_a_pools_slabs_may_be_vmm_memory():
    cfg = parse({"pools": [{"name": "weights", "slab_memory": "vmm"}, {"name": "scratch"}]})
    assert [p.slab_memory for p in cfg.pools] == ["vmm", "pool"]


def test_nixl_and_peers_name_this_node_its_listener_what_it_serves_and_whom():
    cfg = parse({"nixl": {"name": "node-a", "port": 6000, "serve": ["llama/", "qwen"]},
                 "peers": {"node-b": "10.0.0.2:6000", "node-c": "[fd00::3]:6001"}})
    f = cfg.fleet
    assert (f.agent, f.port, f.peers) == ("node-a", 6000, {"node-b": ("10.0.0.2", 6000), "node-c": ("fd00::3", 6001)})
    assert f.serves("llama/8b") and f.serves("qwen") and not f.serves("mistral")
    default = parse({}).fleet
    assert default.port == 5555 and default.peers == {} and not default.serves("anything")
    assert default.agent   # the host name


@pytest.mark.parametrize("data, message", [
    ({"nixl": {"prot": 1}}, "nixl: unknown key(s) prot (did you mean port?)"),
    ({"nixl": {"port": 0}}, "nixl.port: a TCP port, 1 to 65535, got 0"),
    ({"nixl": {"name": "a b"}}, "nixl.name: 1-64 letters"),
    ({"nixl": {"serve": "llama"}}, "nixl.serve: expected list"),
    ({"peers": {"b": "10.0.0.2"}}, 'peers.b: expected "host:port" of the peer\'s NIXL listener'),
    ({"peers": {"b": "10.0.0.2:99999"}}, "peers.b: a TCP port, 1 to 65535, got 99999"),
    ({"peers": {"b#c": "h:1"}}, "peers: 1-64 letters"),
])
def test_bad_fleet_values_say_what_is_expected(data, message):
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert message in str(err.value)
