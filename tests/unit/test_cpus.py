"""How many CPUs spinning may count on: the affinity, narrowed by a cgroup CPU quota, read from
cgroup v2 and v1 trees laid out as the kernel lays them out (here under a temporary directory)."""

from __future__ import annotations

from pathlib import Path

from ipcpool import cpus


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_the_tightest_quota_from_the_process_cgroup_up(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/system.slice/ipcpool.service\n")
    root = tmp_path / "fs"
    _write(root / "system.slice/ipcpool.service/cpu.max", "max 100000\n")   # the service: no limit
    _write(root / "system.slice/cpu.max", "250000 100000\n")                # its slice: 2.5 CPUs
    _write(root / "cpu.max", "max 100000\n")
    assert cpus.quota_cpus(str(root), str(proc)) == 2.5


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    root = tmp_path / "fs"
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cpus.quota_cpus(str(root), str(proc)) == 1.5
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cpus.quota_cpus(str(root), str(proc)) is None


def test_a_container_whose_cgroup_is_the_mounts_root(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/\n")
    _write(tmp_path / "fs/cpu.max", "200000 100000\n")
    assert cpus.quota_cpus(str(tmp_path / "fs"), str(proc)) == 2.0


def test_nothing_readable_is_no_limit(tmp_path):
    assert cpus.quota_cpus(str(tmp_path / "fs"), str(tmp_path / "missing")) is None
    _write(tmp_path / "cgroup", "0::/a\n")
    _write(tmp_path / "fs/a/cpu.max", "garbage\n")
    assert cpus.quota_cpus(str(tmp_path / "fs"), str(tmp_path / "cgroup")) is None


def test_this_process_counts_at_least_one_cpu_and_at_most_its_affinity():
    import os

    assert 1 <= cpus.usable() <= len(os.sched_getaffinity(0))
