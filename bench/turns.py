"""Pairs of processes that hand off in turns: each pair's hand-offs run in rounds, one pair at a
time, so that every line of a comparison meets the same moments of the machine.

A machine shared with others drifts: on a 16-CPU VM with an H100 the floor's p50 moved from 33 to
102 µs between runs minutes apart, and a peer timed a few seconds after another may meet another
machine. Ratios between lines are then worth what the drift is. Taking turns in rounds (each pair
a tenth of its hand-offs, say, then the next pair) spreads each line over the whole run.

A pair's two processes are started, set up and ready before the first round: each signals once it
waits in its loop (the producer for its first go, the consumer before its first), so no pair's
start-up (imports, a CUDA context) runs beside another's timed hand-offs. Between rounds a pair's
consumer waits at its gate, and the first hand-offs of its next round are left out (``SETTLE``);
hand-offs past the timed ones (ipcpool's late reads) wait for the last gate, opened as the pair
finishes alone.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Callable
from unittest import mock

from bench.handoff_peers import STEPS_ENV


# A pair comes back to its round from idling while the others ran (a second, say): the first
# hand-offs of each round after the first meet cold caches and a sleeping CPU, a start the pair
# would not see in a run of its own. They are left out, as the run's first (its warm-up) are.
SETTLE = 5


class Turn:
    """A pair's ``go`` queue (consumer -> producer: ready for the next), as one side sees it: the
    producer's first ``get`` and the consumer's first ``put`` say the side is ready; the consumer's
    ``put`` of hand-off ``i`` waits at its gate first where a round starts at ``i`` (``starts``)."""

    def __init__(self, go: Any, ready: Any, gate: Any = None, starts: tuple[int, ...] = ()):
        self.go, self.ready, self.gate, self.starts = go, ready, gate, frozenset(starts)
        self.count = 0

    def get(self) -> Any:   # the producer's
        if self.count == 0:
            self.ready.put(True)
        self.count += 1
        return self.go.get()

    def put(self, item: Any) -> None:   # the consumer's
        if self.count == 0:
            self.ready.put(True)
        if self.count in self.starts:
            self.gate.get()
        self.count += 1
        self.go.put(item)


def bounds(n: int, rounds: int) -> list[int]:
    """Where each of ``rounds`` rounds of ``n`` hand-offs starts, and ``n``: as even as can be."""
    if rounds < 1 or n < rounds:
        raise ValueError(f"{n} hand-offs cannot be taken in {rounds} rounds")
    return [n * k // rounds for k in range(rounds + 1)]


class Pair:
    """One pair's processes, taking ``rounds`` turns of its ``n`` timed hand-offs."""

    def __init__(self, ctx: Any, label: str, producer: Callable, consumer: Callable, n: int, rounds: int,
                 socket_dir: str | None = None, backend: str | None = None, pipe: bool = False,
                 env: dict[str, str] | None = None):
        # ``n`` hand-offs, ``SETTLE`` more for each round after the first: those are left out
        n += SETTLE * (rounds - 1)
        self.label, self.n, self.bounds = label, n, bounds(n, rounds)
        # SimpleQueues: no feeder thread in the timed processes to contend for their GIL. ``pipe``:
        # the pair also gets the two ends of one AF_UNIX socketpair (the floor's notice).
        go, link, acks, self.out = ctx.SimpleQueue(), ctx.SimpleQueue(), ctx.SimpleQueue(), ctx.SimpleQueue()
        self.ready, self.gate = ctx.SimpleQueue(), ctx.SimpleQueue()
        ends = ctx.Pipe(duplex=True) if pipe else ()
        # every round's start, and n: what follows the timed hand-offs waits for the pair's finish
        producer_go, consumer_go = Turn(go, self.ready), Turn(go, self.ready, self.gate, tuple(self.bounds[:-1]) + (n,))
        self.procs = [ctx.Process(target=producer, args=(socket_dir, backend, n, producer_go, link, acks, *ends[:1])),
                      ctx.Process(target=consumer, args=(socket_dir, backend, n, consumer_go, link, acks, self.out, *ends[1:]))]
        # Held here: a started process lets go of its arguments, and a queue collected before the
        # child unpickles it takes its semaphore with it.
        self._shared = (go, link, acks, ends)
        self.samples: list[int] = []
        self._steps = tempfile.NamedTemporaryFile("r", prefix="handoff-steps-", suffix=".jsonl")
        self._env = {STEPS_ENV: self._steps.name, **(env or {})}   # (inherited as they start)
        self._reported: list[dict] | None = None   # the processes' step reports, once they ended

    def start(self) -> None:
        with mock.patch.dict(os.environ, self._env):   # (the environment as it was, after)
            for proc in self.procs:
                proc.start()

    def wait_ready(self, timeout: float = 300) -> None:
        waiting = len(self.procs)
        until = time.monotonic() + timeout
        while waiting:
            if self.ready._reader.poll(0.5):
                self.ready.get()
                waiting -= 1
            elif any(proc.exitcode not in (None, 0) for proc in self.procs):
                raise RuntimeError(f"{self.label}: a process ended before its first hand-off")
            elif time.monotonic() > until:
                raise TimeoutError(f"{self.label}: not ready after {timeout:g} s")

    def round(self, k: int, on_sample: Callable[[], None] = lambda: None) -> None:
        """Round ``k``: let the consumer go on and take its hand-offs' latencies (ns), all but the
        first ``SETTLE`` of each round after the first (whose first hand-offs are the run's warm-up)."""
        self.gate.put(True)
        for j in range(self.bounds[k + 1] - self.bounds[k]):
            if not self.out._reader.poll(120):
                raise TimeoutError(f"{self.label}: no hand-off for 120 s")
            latency = self.out.get()
            if k == 0 or j >= SETTLE:
                self.samples.append(latency)
            on_sample()

    def finish(self, of: str = "p50_us") -> dict[str, dict[str, float]]:
        """Let the pair end (its untimed hand-offs, its step reports) and stop it; each process's
        step p50s (``of="mean_us"``: means), as its report on stderr has them ("producer",
        "consumer", ...: a process reporting two sets gets both, in order). Again: as kept."""
        if self._reported is None:
            self.gate.put(True)
            self.stop()
            self._reported = [json.loads(line) for line in self._steps.read().splitlines()]
            self._steps.close()
        by_who: dict[str, dict[str, float]] = {}
        for r in self._reported:
            by_who.setdefault(r["who"], {}).update(r.get(of, {}))
        return by_who

    def stop(self) -> None:
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
