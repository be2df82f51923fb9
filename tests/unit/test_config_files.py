"""The shipped config file, and config mistakes that name the fix."""

import pytest

from ipcpool.config import ConfigError, load, parse


def test_the_shipped_config_loads():
    from pathlib import Path

    config = load(Path(__file__).resolve().parents[2] / "deploy/broker.toml")
    assert [p.name for p in config.pools] == ["default"]


def test_a_pools_table_points_to_the_array_form():
    import tomllib

    with pytest.raises(ConfigError, match=r'pools: a list of \[\[pools\]\] tables .* write \[\[pools\]\] then '
                                          r'name = "weights" instead of \[pools.weights\]'):
        parse(tomllib.loads('[pools.weights]\nmax_size = "1G"\n'))
