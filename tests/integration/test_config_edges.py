"""Config mistakes a user makes, as `ipcpool broker --config` tells them (exit 2, one line)."""

import subprocess
import sys

import pytest

from ipcpool.config import load


def _broker(tmp_path, text: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "b.toml"
    cfg.write_text(text)
    return subprocess.run([sys.executable, "-m", "ipcpool", "broker", "--config", str(cfg),
                           "--socket-dir", str(tmp_path / "s"), "--backend", "host"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("text, said", [
    # A size without its unit: a pool that would refuse every allocation.
    ('[[pools]]\nname = "default"\nmax_size = "100"\n',
     'pools[0].max_size: 100 bytes cannot serve an allocation; a pool needs at least 1M (sizes take a unit: "512M", "100G")'),
    ('metrics_adress = "127.0.0.1:9464"\n', "unknown key(s) metrics_adress (did you mean metrics_address?)"),
    ('[[pools]]\nname = "default"\nmax_sise = "1G"\n', "pools[0]: unknown key(s) max_sise (did you mean max_size?)"),
    ('[quotas.no-such-user-29]\nbytes = "1G"\n', "quotas.no-such-user-29: expected a uid, a user's name or 'default'"),
    ('socket_mode = "0770"\n', "socket_mode: rwx for the owner, no write for group or others"),
])
def test_a_bad_config_is_refused_at_start_naming_its_key(tmp_path, text, said):
    out = _broker(tmp_path, text)
    assert out.returncode == 2 and said in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr   # one line, no traceback


def test_users_are_named_like_groups(tmp_path):
    f = tmp_path / "b.toml"
    f.write_text('[access]\nuids = ["nobody", 0]\n[quotas.nobody]\nbytes = "1G"\n[quotas.0]\nobjects = 3\n')
    cfg = load(f)
    assert cfg.allow_uids == {65534, 0}
    assert cfg.quota_for(65534).bytes == 1 << 30 and cfg.quota_for(0).objects == 3
