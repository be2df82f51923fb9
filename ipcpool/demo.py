"""`ipcpool demo`: a producer process writes a pattern into broker memory, a consumer verifies it."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os

from .client import connect

DEMO_BYTES = 4 << 20


def _pattern(n: int) -> bytes:
    return (hashlib.sha256(b"ipcpool demo").digest() * (n // 32 + 1))[:n]


def _producer(socket_dir, to_consumer, from_consumer) -> None:
    with connect(socket_dir) as client:
        with client.allocate(DEMO_BYTES) as buf:
            buf.view[:] = _pattern(DEMO_BYTES)
            to_consumer.put((os.getpid(), client.backend, buf.share()))
            from_consumer.get(timeout=60)   # keep the memory until the consumer has checked it


def _consumer(socket_dir, from_producer, to_producer, results) -> None:
    pid, backend, token = from_producer.get(timeout=60)
    with connect(socket_dir) as client:
        with client.open(token) as buf:
            ok = bytes(buf.view) == _pattern(DEMO_BYTES)
            results.put((pid, os.getpid(), backend, buf.size, ok))
    to_producer.put("done")


def run(socket_dir) -> bool:
    ctx = mp.get_context("spawn")
    to_consumer, to_producer, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_producer, args=(socket_dir, to_consumer, to_producer)),
        ctx.Process(target=_consumer, args=(socket_dir, to_consumer, to_producer, results)),
    ]
    for p in procs:
        p.start()
    try:
        producer, consumer, backend, size, ok = results.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    print(f"producer pid {producer} wrote a {size >> 20} MiB pattern into broker memory ({backend} backend)")
    print(f"consumer pid {consumer} opened the same memory zero-copy and "
          + ("verified every byte: OK" if ok else "found DIFFERENT bytes: FAILED"))
    return ok
