"""The metrics endpoint as a scraper sees it: process figures, build info, every pool figure, no
_created series, and no series left behind for a uid that holds nothing."""

import os
import re
import socket
import time
import urllib.request

import ipcpool
from ipcpool import __version__


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


def _value(text: str, series: str) -> float | None:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _refreshed(client, address: str) -> str:
    time.sleep(1.1)    # gauges refresh about once a second, on the broker's next request
    client.stats()
    return _scrape(address)


def test_metrics_have_process_build_and_pool_series_and_forget_idle_uids(start_broker):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    b = start_broker(config_text=f'metrics_address = "{address}"\n[[pools]]\nname = "default"\nmax_size = "64M"\n')
    uid = f'ipcpool_uid_bytes{{uid="{os.getuid()}"}}'
    with ipcpool.connect(b.socket_dir) as admin:
        with ipcpool.connect(b.socket_dir, arena_bytes=1 << 20) as c:
            buf = c.allocate(4096)                      # carved: an arena of the pool
            g = c.create_growable("m/g", 1 << 20)
            text = _refreshed(admin, address)
            assert _value(text, "process_open_fds") > 0 and _value(text, "process_resident_memory_bytes") > 0
            assert _value(text, f'ipcpool_build_info{{backend="host",python="{__import__("platform").python_version()}",'
                                f'version="{__version__}"}}') == 1
            assert _value(text, 'ipcpool_pool_bytes{kind="max_size",pool="default"}') == 64 << 20
            assert _value(text, 'ipcpool_pool_bytes{kind="arena_bytes",pool="default"}') == 1 << 20
            assert _value(text, 'ipcpool_pool_bytes{kind="growable_bytes",pool="default"}') >= 1 << 20
            assert _value(text, 'ipcpool_arenas{pool="default"}') == 1
            assert _value(text, 'ipcpool_growables{pool="default"}') == 1
            assert _value(text, uid) > 0
            assert "_created" not in text
            buf.free()
            g.close()
            c.delete_growable("m/g")
        text = _refreshed(admin, address)
        assert _value(text, uid) is None, [line for line in text.splitlines() if "uid_bytes" in line]
