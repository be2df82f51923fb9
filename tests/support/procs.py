"""Running client code in spawned processes: each target gets a shared queue to report on."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

SPAWN = mp.get_context("spawn")


def run_together(jobs, timeout: float = 120.0) -> list:
    """Run each ``(target, args)`` as ``target(*args, out)`` in its own spawned process, with one
    shared queue ``out``; return one result per process (in completion order). Kills stragglers
    and fails on a non-zero exit."""
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=target, args=(*args, q)) for target, args in jobs]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                results.append(q.get(timeout=0.2))
            except queue.Empty:   # a child that died before reporting fails the run now
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"child exit codes {codes}; results {results}"
    return results


def run_procs(target, args_list, timeout: float = 120.0) -> list:
    """``run_together`` for one target, once per args."""
    return run_together([(target, args) for args in args_list], timeout)
