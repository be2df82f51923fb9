"""The scripts under scripts/ and bench/: their help, their options, and what they talk about."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["scripts/gpu_suite.sh", "scripts/fetch_wheels.sh"])
def test_shell_scripts_explain_every_option(script):
    out = subprocess.run(["bash", str(ROOT / script), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith(f"usage: {script}"), out.stderr
    cases = re.findall(r"^\s+(-[-\w|]+)\)", (ROOT / script).read_text(), re.M)   # the option parser's
    options = {o for case in cases for o in case.split("|")}
    assert {"-h", "--help"} < options
    for option in options:
        assert re.search(rf"^\s+(-h, )?{re.escape(option)}\b", out.stdout, re.M), f"{script}: {option} not in --help"
    bad = subprocess.run(["bash", str(ROOT / script), "--nonsense"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "see --help" in bad.stderr


def test_project_files_speak_of_the_project():
    """Nothing in the tree talks about the machinery a session of work happened to run on."""
    words = re.compile(r"KINDS[.]md|[.]library|files come back|device call|the `run`[ ]tool")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    hits = [f for f in tracked if f.endswith((".sh", ".py", ".md", ".toml", ".service", "Makefile"))
            and words.search((ROOT / f).read_text(errors="replace")) and f != "tests/integration/test_scripts.py"]
    assert hits == []


def test_every_script_is_referenced():
    docs = "".join(p.read_text() for p in [ROOT / "README.md", ROOT / "bench/README.md", ROOT / "scripts/gpu_suite.sh",
                                           *(ROOT / "docs").glob("*.md")])
    for path in sorted((ROOT / "scripts").iterdir()):
        assert f"scripts/{path.name}" in docs, f"scripts/{path.name} is documented nowhere"


def test_the_handoff_profile_runs_on_the_host_backend(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench/profiles.py"), "handoff", "--backend", "host",
                          "--handoffs", "20", "--out", str(tmp_path), "--top", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "hand-off under the profiler: p50" in out.stdout
    assert sorted(p.name for p in tmp_path.glob("*.prof")) == ["broker.prof", "consumer.prof", "producer.prof"]


def test_the_handoff_to_a_reader_that_arrived_first_runs_on_the_host_backend(tmp_path):
    """Each producer starts 2 ms after its consumer asked: ipcpool's reader, asleep past its spin,
    is woken by the broker and still reads from the directory (no hand-off counted without it)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff.py"), "--backend", "host", "--handoffs", "60",
                          "--writer-late-ms", "2", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "handoff_host_late.json").read_text())
    assert result["writer_late_ms"] == 2 and set(result["peers"]) == {"ipcpool", "floor", "shared_memory"}
    assert all(row["p50_us"] > 0 for row in result["peers"].values())
    assert "consumer step p50 (mean): start->got lease" in out.stderr and "without the directory" not in out.stderr
    assert "hand-offs waited past the reader's spin (it asked the broker to wake it)" in out.stderr
    steps = result["peers"]["ipcpool"]["steps_p50_us"]   # the step report, kept with the figures
    assert set(steps["producer"]) == {"create", "view", "fill", "seal", "create+view+seal"}
    assert "get once sealed" in steps["consumer"] and "get+view" in steps["consumer"]
    assert all(p50 > 0 for who in steps.values() for p50 in who.values()), steps
    means = result["peers"]["ipcpool"]["steps_mean_us"]   # ... with each step's mean beside
    assert set(means["producer"]) == set(steps["producer"]) and all(v > 0 for v in means["producer"].values())


def test_the_handoff_to_a_reader_waiting_for_a_busy_writers_seal_runs_on_the_host_backend(tmp_path):
    """Each producer works 3 ms after its fill: every line's hand-off takes at least that, and
    ipcpool's reader, asleep on the board word, reads from the directory, with no wake request."""
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff.py"), "--backend", "host", "--handoffs", "40",
                          "--writer-busy-ms", "3", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=180, env={**os.environ, "IPCPOOL_GET_SPIN_US": "100"})
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "handoff_host_busy.json").read_text())
    assert result["writer_busy_ms"] == 3 and set(result["peers"]) == {"ipcpool", "floor", "shared_memory"}
    assert all(row["p50_us"] >= 3000 for row in result["peers"].values()), result["peers"]
    assert "without the directory" not in out.stderr, out.stderr


def _handoff_ab(tmp_path, side: str) -> str:
    """A host run of bench/handoff.py alternating ``side``'s C and Python calls: its stderr."""
    pytest.importorskip("ipcpool.shm._native", reason="not built here (no C compiler when installed)")
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff.py"), "--backend", "host", "--handoffs", "40",
                          f"--{side}-ab", "--skip", "floor", "--out-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stderr


def test_the_handoff_compares_the_readers_c_and_python_lookups_hand_off_by_hand_off(tmp_path):
    """--reader-ab: one line for each lookup, each over half the hand-offs (where the C part is built)."""
    err = _handoff_ab(tmp_path, "reader")
    for side in ("C", "Python"):
        assert f"reader with the {side} lookup: start->got lease p50 " in err, err
        assert "(20 hand-offs); get once sealed" in err.split(f"reader with the {side} lookup")[1], err


def test_the_handoff_compares_the_writers_c_and_python_calls_hand_off_by_hand_off(tmp_path):
    """--writer-ab: the writer's create + view + seal and the whole hand-off, for each half."""
    err = _handoff_ab(tmp_path, "writer")
    for side in ("C", "Python"):
        assert f"writer with the {side} calls: start->got lease p50 " in err, err
        assert f"writer with its {side} calls: create+view+seal p50 " in err, err
    assert err.count("(20 hand-offs)") == 2 and err.count(" µs (20)\n") == 2, err
    both = subprocess.run([sys.executable, str(ROOT / "bench/handoff.py"), "--reader-ab", "--writer-ab"],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "one at a time" in both.stderr


def test_the_handoff_refuses_to_skip_a_line_it_cannot():
    """ipcpool and the usual peer are the figures' point: a --skip of them (or a typo) is an error,
    not a run that quietly keeps them."""
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff.py"), "--skip", "cuda.core,torch.multiprocessing"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--skip takes floor and cuda.core, got torch.multiprocessing" in out.stderr


def test_the_handoff_timeline_runs_on_the_host_backend(tmp_path):
    """The broker's moments of every hand-off come from its trace events (``IPCPOOL_TRACE``), the
    writer's and the reader's from theirs: every segment of the timeline is there for each."""
    # The reader reads from the directory (its events) only where it spins for the entry: on any
    # number of CPUs here, long enough that the writer's create always comes within it.
    env = {**os.environ, "IPCPOOL_GET_SPIN_US": "100000"}
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff_timeline.py"), "--backend", "host",
                          "--handoffs", "30", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=180,
                         env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    [path] = tmp_path.glob("handoff_timeline_host_*.json")
    result = json.loads(path.read_text())
    segments = {s["label"]: s for s in result["segments"]}
    for label in ("create: until its frame leaves", "broker: create to directory entry", "create returns (after its frame)",
                  "view and fill", "seal: record, post the board word", "reader orders after the seal", "get returns",
                  "view and read one element", "whole hand-off"):
        assert segments[label]["n"] == 30 and segments[label]["p50_us"] > 0, segments[label]
    # The reader may find the entry, or see the seal, a moment before the other side's stamp.
    for label in ("reader finds the entry", "reader sees the seal"):
        assert segments[label]["n"] == 30, segments[label]
    assert 0 <= result["entry_before_seal"] <= 1
    assert result["asked_broker"]["n"] == 0 and result["whole_p99_us"] >= segments["whole hand-off"]["p50_us"]
    assert result["woken"]["n"] == 0   # (its spin outlasts every wait here)
    # A frame the writer puts in its request ring may be the spinning broker's before the writer's
    # own trace event stamps it sent (a trip of either sign). The create's comes before the reader
    # can find its entry, so within the hand-off; the seal's is off its path (the reader goes on
    # from the board word), and on a machine of two CPUs the spinning reader may hold it up.
    for label in ("create reaches the broker", "seal reaches the broker"):
        assert segments[label]["n"] == 30, segments[label]
    create_trip = segments["create reaches the broker"]["p50_us"]
    assert abs(create_trip) < segments["whole hand-off"]["p50_us"], segments["create reaches the broker"]
    assert result["handlers_us"]["create"] > 0 and result["handlers_us"]["seal"] > 0


def test_the_handoff_steps_run_by_ipcpool_and_by_hand_on_the_host_backend(tmp_path):
    """Both kinds of each step are timed in one run, the by-hand reader reading the broker's own
    directory (a name it could not find there, or a wrong range, would fail the run)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff_steps.py"), "--backend", "host",
                          "--handoffs", "200", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    steps = json.loads((tmp_path / "handoff_steps_host.json").read_text())["steps"]
    assert set(steps) == {"writer create+view+seal", "reader get+view (sealed)"}
    for label, row in steps.items():
        assert row["ipcpool_n"] > 50 and row["by_hand_n"] > 50, (label, row)
        assert row["ipcpool_p50_us"] > 0 and row["by_hand_p50_us"] > 0, (label, row)
    assert "writer create+view+seal" in out.stdout and "ipcpool writer p50: create" in out.stdout


def test_the_host_attach_splits_each_attach_into_its_phases(tmp_path):
    """Every phase is seen (by the attaching client's trace events), and together they are the attach."""
    out = subprocess.run([sys.executable, str(ROOT / "bench/host_attach.py"), "--mib", "4", "--counts", "1", "64",
                          "--repeat", "1", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    [path] = tmp_path.glob("host_attach_*.json")
    rows = json.loads(path.read_text())["trees"]["this"]["rows"]
    assert sorted(rows) == ["1", "64"]
    for row in rows.values():
        phases = row["phases_ms"]
        assert row["ok"] and list(phases) == ["request", "decode", "pool", "leases", "arrays"]
        assert all(ms > 0 for ms in phases.values()), phases
        assert sum(phases.values()) == pytest.approx(row["attach_ms"], abs=0.01)


def test_the_interleaved_handoff_comparison_runs_on_the_host_backend(tmp_path):
    """Two trees (this checkout under two names), two rounds: a p50 per run of each, in turn."""
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff_ab.py"), "--backend", "host",
                          "--tree", f"again={ROOT}", "--rounds", "2", "--handoffs", "20", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    [path] = tmp_path.glob("handoff_ab_host_*.json")
    result = json.loads(path.read_text())
    assert list(result["trees"]) == ["again", "this"]
    for row in result["trees"].values():
        assert len(row["runs"]) == 2 and all(r["p50_us"] > 0 for r in row["runs"])
        assert row["p50_min_us"] <= row["p50_median_us"] <= row["p50_max_us"]
        # the pair's per-step p50s, parsed from its stderr: where a difference between trees lies
        steps = row["step_p50_medians_us"]
        assert {"producer create", "producer seal", "consumer start->got lease", "consumer read"} <= set(steps)
        assert all(v > 0 for v in steps.values())
    assert result["trees"]["again"]["vs_first"] == 1.0
    assert "step (median of p50s, µs)" in out.stdout


def test_the_interleaved_handoff_comparison_refuses_a_tree_without_the_benchmark(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff_ab.py"), "--tree", f"old={tmp_path}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--tree takes NAME=DIR, DIR a checkout with bench/handoff.py" in out.stderr


def test_the_grow_profile_runs_on_the_host_backend(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench/profiles.py"), "grow", "--backend", "host",
                          "--start-mib", "2", "--max-mib", "16", "--out", str(tmp_path), "--top", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    steps = re.search(r"grow steps under the profiler \(host\), µs: (.*); ([\d.]+) ms in all", out.stdout)
    assert steps and [s.split()[0] for s in steps[1].split(", ")] == ["2", "4", "8", "16"]
    assert sorted(p.name for p in tmp_path.glob("*.prof")) == ["broker.prof", "grower.prof"]


def test_the_weights_benchmark_runs_on_the_host_backend(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench/weights.py"), "--backend", "host", "--cases", "small",
                          "--repeat", "1", "--rounds", "3", "--readers", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    [path] = tmp_path.glob("weights_host_*.json")
    result = json.loads(path.read_text())
    assert result["machine"]["date"] and result["backend"] == "host"
    [small] = result["results"]
    assert [r["swap_s"] > 0 for r in small["swap_ipcpool_rounds"]] == [True] * 3
    assert small["attach_ipcpool_s"] > 0 and small["load_floor_s"] > 0
    # Swaps after the first write the spare: the pool's high mark is two versions. (At least one:
    # a reader's release may reach a busy broker after the next publish's begin, which then takes
    # fresh memory; the bench reports the most, ``swap_ipcpool_most_versions_resident``.)
    steady = [r["used_high"] for r in small["swap_ipcpool_rounds"][1:]]
    assert min(steady) == 2 * small["swap_ipcpool_version_bytes"], steady
    # Where the writer's time went, round by round (the host writes through numpy: no copy phase).
    phases = small["swap_ipcpool_phases"]
    assert phases["begin_s"] > 0 and phases["views_s"] > 0 and phases["publish_call_s"] > 0, phases
    assert all(len(r["refresh_s"]) == 2 for r in small["swap_ipcpool_rounds"])


def test_the_handoff_lines_take_turns_in_rounds_and_keep_every_timed_hand_off(tmp_path):
    """Three rounds, the lines in turn: each line still reports exactly the hand-offs asked for
    (the first of each later round left out as the warm-up is, and made up for)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff.py"), "--backend", "host", "--handoffs", "30",
                          "--rounds", "3", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "handoff_host.json").read_text())
    assert result["rounds"] == 3 and set(result["peers"]) == {"ipcpool", "floor", "shared_memory"}
    assert [row["n"] for row in result["peers"].values()] == [30, 30, 30]
    assert "3 lines in 3 rounds" in out.stdout


@pytest.mark.parametrize("rounds", ["0", "31"])
def test_the_handoff_refuses_rounds_it_cannot_cut(tmp_path, rounds):
    out = subprocess.run([sys.executable, str(ROOT / "bench/handoff.py"), "--backend", "host", "--handoffs", "30",
                          "--rounds", rounds, "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"--rounds is 1 to --handoffs (30), got {rounds}" in out.stderr
    assert not list(tmp_path.iterdir())
