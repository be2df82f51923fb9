"""Does CUDA memory outlive the process that made it, when another process keeps its FDs?

A crash-tolerant broker needs this: the broker dies, systemd's FD store keeps the FDs it exported,
a restarted broker adopts the memory. Three 'spawn' processes, joined by AF_UNIX SEQPACKET
socketpairs that carry the FDs by SCM_RIGHTS:

  EXPORTER  the old broker: an IPC pool allocation (0xA5A5A5A5) and a VMM allocation (0x5A5A5A5A),
            exported as POSIX FDs and sent to the KEEPER; then it dies without freeing anything,
            by os._exit(0) (variant "exit") or by the parent's SIGKILL (variant "kill").
  KEEPER    systemd's FD store: no CUDA. Holds the FDs across the death, passes duplicates on.
  ADOPTER   the restarted broker: imports both, checks the patterns, writes and reads back, tries a
            new allocation from the imported pool, frees, and follows cuMemGetInfo until the
            keeper's copies are gone too.

Each adopter step is announced to the parent before it runs and its outcome ("ok", the CUresult
name, or the exception) after, so a segfault leaves the step it died in, next to the exit code.
Every wait has a timeout. cuda.bindings is imported inside the roles: --help needs no GPU.

    python scripts/probe_durable.py                       # both variants, JSON in bench/results/
    python scripts/probe_durable.py --variant kill --out /tmp/durable.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys

# The roles run in spawned children, which import probe_durable_roles by name (scripts/ is on the
# path the children inherit).
from probe_durable_roles import SIZE, adopter_main, exporter_main, keeper_main

RESULTS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "results"))


# ----------------------------------------------------------------------------------------- parent

def _wait(conn, kinds: set, steps: dict, timeout: float) -> tuple:
    """Read (kind, ...) messages until one of ``kinds``; steps go to ``steps``. ("timeout",)/("eof",)."""
    while True:
        if not conn.poll(timeout):
            return ("timeout",)
        try:
            msg = conn.recv()
        except EOFError:              # the child is gone (crash, or it exited early)
            return ("eof",)
        if msg[0] == "step":
            steps[msg[1]] = msg[2]
        elif msg[0] in kinds:
            return msg


def _join(p, timeout: float):
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(5)
        return f"hung after {timeout:.0f} s, killed"
    code = p.exitcode
    return f"{code} ({signal.strsignal(-code)})" if code is not None and code < 0 else code


def run_variant(variant: str, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    out = {"variant": variant, "exporter": {"steps": {}}, "keeper": {"steps": {}}, "adopter": {"steps": {}}}
    pipes = {r: ctx.Pipe() for r in out if r != "variant"}
    ctl = {r: pipes[r][0] for r in pipes}
    ek = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ka = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    procs = {
        "exporter": ctx.Process(target=exporter_main, args=(pipes["exporter"][1], ek[0], variant == "kill")),
        "keeper": ctx.Process(target=keeper_main, args=(pipes["keeper"][1], ek[1], ka[0], timeout)),
        "adopter": ctx.Process(target=adopter_main, args=(pipes["adopter"][1], ka[1], timeout)),
    }

    def start(role: str, *socks) -> None:
        procs[role].start()
        for end in (pipes[role][1], *socks):  # our copies must go, or a dead child never reads as EOF
            end.close()

    try:
        start("keeper", ek[1], ka[0])
        start("exporter", ek[0])
        for role, kind in (("exporter", "sent"), ("keeper", "holding")):
            msg = _wait(ctl[role], {kind, "error"}, out[role]["steps"], timeout)
            out[role]["status"] = f"error: {msg[1]}" if msg[0] == "error" else msg[0]
            if msg[0] != kind:
                return out
            if role == "exporter":
                out["exporter"].update(msg[1])
        if variant == "kill":
            os.kill(procs["exporter"].pid, signal.SIGKILL)
        out["exporter"]["exitcode"] = _join(procs["exporter"], timeout)   # dead before anyone adopts
        ctl["keeper"].send("exporter_dead")
        start("adopter", ka[1])
        steps = out["adopter"]["steps"]
        while (msg := _wait(ctl["adopter"], {"wait_keeper", "done"}, steps, timeout))[0] == "wait_keeper":
            ctl["keeper"].send("release")                 # the FD store lets go of the last copies
            out["keeper"]["exitcode"] = _join(procs["keeper"], timeout)
            ctl["adopter"].send("keeper_gone")
        out["adopter"]["status"] = msg[0]
        out["adopter"]["last_step"] = next(reversed(steps), None)
    finally:
        for role, p in procs.items():                       # nothing may outlive the probe
            if p.pid is not None and "exitcode" not in out[role]:
                if role == "keeper" and p.is_alive():
                    try:
                        ctl["keeper"].send("release")
                    except OSError:
                        pass
                out[role]["exitcode"] = _join(p, 5 if role == "exporter" else timeout)
        for end in (*ek, *ka):
            end.close()
    return out


def _summary(run: dict) -> dict:
    """Exit codes, then each adopter step group's first failure, then free memory against the start."""
    rows = {f"{r} exit": run[r].get("exitcode", "not started") for r in ("exporter", "keeper", "adopter")}
    if run["exporter"].get("status", "").startswith("error"):
        rows["exporter exit"] = run["exporter"]["status"]
    steps, groups = run["adopter"]["steps"], {}
    for key, value in steps.items():
        if not key.startswith("free_mib."):
            group, _, what = key.rpartition(".")
            if groups.get(group or key, "ok") == "ok":   # keep the group's first failure
                groups[group or key] = "ok" if value == "ok" else f"CRASHED in {what}" if value == "started" \
                    else f"{what}: {value}"
    rows.update(groups)
    start = steps.get("free_mib.start")
    for key, value in steps.items():
        if key.startswith("free_mib.") and key != "free_mib.start":
            ok = isinstance(value, float) and isinstance(start, float)
            rows[f"free MiB vs start, {key[9:]}"] = f"{value - start:+.1f}" if ok else value
    return rows


def _nvidia_smi() -> tuple[str | None, str | None]:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True, timeout=30, check=False)
        name, version = (s.strip() for s in p.stdout.strip().splitlines()[0].split(","))
        return name, version
    except Exception:  # noqa: BLE001 (no nvidia-smi, or odd output: the JSON says null)
        return None, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("exit", "kill", "both"), default="both",
                    help="how the exporter dies: os._exit(0), SIGKILL, or both one after the other")
    ap.add_argument("--out", help="JSON path (default bench/results/durable_probe_<device>_<date>.json)")
    ap.add_argument("--timeout", type=float, default=60, help="seconds for every wait on a child")
    args = ap.parse_args()

    runs = {}
    for v in (("exit", "kill") if args.variant == "both" else (args.variant,)):
        print(f"variant {v}: the exporter dies by {'os._exit(0)' if v == 'exit' else 'SIGKILL'}", flush=True)
        runs[v] = run_variant(v, args.timeout)
        runs[v]["summary"] = _summary(runs[v])
    smi_name, smi_driver = _nvidia_smi()
    exp = next((r["exporter"] for r in runs.values() if "device" in r["exporter"]), {})
    name = exp.get("device") or smi_name or "unknown"
    now = datetime.datetime.now(datetime.UTC)
    out = {"what": "CUDA pool and VMM memory kept alive by FDs another process holds after its creator died",
           "device": name, "driver": exp.get("driver"), "driver_version": smi_driver,
           "date": now.isoformat(timespec="seconds"), "variant": args.variant, "size": SIZE, "runs": runs}

    rows = list(dict.fromkeys(k for r in runs.values() for k in r["summary"]))
    cells = {v: [str(r["summary"].get(k, "-"))[:64] for k in rows] for v, r in runs.items()}
    widths = {v: max(len(v), *map(len, c)) + 2 for v, c in cells.items()}
    print("".ljust(max(map(len, rows)) + 2) + "".join(v.ljust(widths[v]) for v in runs))
    for i, row in enumerate(rows):
        print(row.ljust(max(map(len, rows)) + 2) + "".join(cells[v][i].ljust(widths[v]) for v in runs))

    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_").removeprefix("nvidia_")
    path = args.out or os.path.join(RESULTS, f"durable_probe_{slug}_{now:%Y%m%d}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
