"""`ipcpool ...`: broker, status, stats, trim, ls, rm, load, demo, doctor. The only place that
configures logging."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from . import backend as backends
from .errors import IpcPoolError, ObjectNotFound

log = logging.getLogger("ipcpool")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_broker(args) -> int:
    from .broker import Broker
    from .config import load

    config = load(args.config)
    choice = backends.choose(args.backend or (config.backend if config.backend != "auto" else None))
    broker = Broker(config, choice, args.socket_dir)
    try:
        broker.start()
    except OSError as exc:   # the directory, a socket, a pool: say which and why, no traceback
        raise IpcPoolError(f"cannot start: {exc}") from exc
    try:
        broker.serve_forever()
    finally:
        broker.close()
    return 0


def _stats_table(stats: dict) -> str:
    cols = ("reserved", "used", "reserved_high", "used_high", "arena_free", "growable_bytes")
    lines = [f"backend {stats['backend']}  sessions {stats['sessions']}  objects {stats.get('objects', 0)}"
             f"  pid {stats['pid']}",
             f"{'pool':<16}" + "".join(f"{c:>16}" for c in cols) + f"{'allocations':>13}"]
    for name, s in stats["pools"].items():
        lines.append(f"{name:<16}" + "".join(f"{_human(s.get(c, 0)):>16}" for c in cols) + f"{s['allocations']:>13}")
    return "\n".join(lines)


def cmd_stats(args) -> int:
    import time

    from .client import connect

    with connect(args.socket_dir) as client:
        if not args.watch:
            stats = client.stats()
            print(json.dumps(stats, indent=2) if args.json else _stats_table(stats))
            return 0
        shown = 0
        while args.count is None or shown < args.count:
            table = _stats_table(client.stats())
            # Redraw in place on a terminal; one table after another otherwise (logs, pipes).
            print(("\x1b[H\x1b[2J" if sys.stdout.isatty() else "") + time.strftime("%H:%M:%S  ") + table, flush=True)
            shown += 1
            if args.count is None or shown < args.count:
                time.sleep(args.interval)
    return 0


def cmd_status(args) -> int:
    from .client import connect

    with connect(args.socket_dir) as client:
        s = client.stats()
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    up = int(s["uptime"])
    print(f"ipcpool {s['version']}  pid {s['pid']}  up {up // 3600}h{up % 3600 // 60:02d}m{up % 60:02d}s")
    print(f"backend {s['backend']}  sessions {s['sessions']}  objects {s['objects']}  socket dir {client.socket_dir}")
    for name, p in s["pools"].items():
        print(f"pool {name}: {_human(p['used'])} used of {_human(p['reserved'])} reserved, "
              f"{p['allocations']} allocation(s)")
    return 0


def cmd_trim(args) -> int:
    from .client import connect

    with connect(args.socket_dir) as client:
        before = client.stats()["pools"].get(args.pool, {}).get("reserved")
        client.trim(args.pool, args.keep)
        after = client.stats()["pools"][args.pool]["reserved"]
    print(f"pool {args.pool}: reserved {_human(before)} -> {_human(after)}")
    return 0


def _print_table(rows: list[tuple[str, ...]], left: set[int]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def cmd_ls(args) -> int:
    from .client import connect

    with connect(args.socket_dir) as client:
        objects = client.list(args.prefix)
        growables = client.list_growables(args.prefix)
    if args.json:
        print(json.dumps({"objects": objects, "growables": growables}, indent=2))
        return 0
    rows = [("NAME", "SIZE", "DTYPE", "SHAPE", "STATE", "LEASES")]
    for o in objects:
        shape = o["meta"].get("shape")
        rows.append((o["name"], _human(o["size"]), o["meta"].get("dtype") or "-",
                     "x".join(map(str, shape)) if shape is not None else "-", o["state"], str(o["leases"])))
    _print_table(rows, {0, 2, 3, 4})
    print(f"{len(objects)} object(s), {_human(sum(o['size'] for o in objects))}")
    if growables:
        print()
        rows = [("GROWABLE", "SIZE", "CHUNKS", "POOL", "STATE", "ATTACHED")]
        rows += [(g["name"], _human(g["size"]), str(g["chunks"]), g["pool"], g["state"], str(g["attached"]))
                 for g in growables]
        _print_table(rows, {0, 3, 4})
        print(f"{len(growables)} growable buffer(s), {_human(sum(g['size'] for g in growables))}")
    return 0


def cmd_rm(args) -> int:
    from .client import connect

    failed = 0
    with connect(args.socket_dir) as client:
        for name in args.names:
            try:
                try:
                    client.delete(name)
                except ObjectNotFound:   # not an object: a growable buffer of that name?
                    try:
                        client.delete_growable(name)
                    except ObjectNotFound:
                        raise ObjectNotFound(f"no object or growable buffer named {name!r}") from None
            except IpcPoolError as exc:
                print(f"ipcpool rm: {name}: {exc}", file=sys.stderr)
                failed += 1
    return 1 if failed else 0


def cmd_load(args) -> int:
    from .client import connect
    from .loader import load

    with connect(args.socket_dir) as client:
        names = load(client, args.file, prefix=args.prefix, pool=args.pool)
    print(f"loaded {len(names)} tensor(s) from {args.file} as sealed objects under {args.prefix or '(no prefix)'}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run

    return 0 if run(args.socket_dir) else 1


def cmd_doctor(args) -> int:
    ok, why = backends.probe_cuda()
    print(f"CUDA: {'usable' if ok else 'not usable'} ({why})")
    try:
        choice = backends.choose(args.backend)
        print(f"backend chosen: {choice.name} ({choice.reason})")
    except IpcPoolError as exc:
        print(f"backend: {exc}")
        return 1
    if ok:
        from .backend.cuda import capabilities

        caps = capabilities()
        if args.json:
            print(json.dumps(caps, indent=2, default=str))
        else:
            for key, value in caps.items():
                print(f"  {key}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ipcpool", description="Share GPU and host memory between processes.")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("broker", help="run the broker in the foreground")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--socket-dir", help="directory of the sockets (default: $IPCPOOL_SOCKET_DIR, ...)")
    p.add_argument("--backend", choices=backends.BACKENDS, help="memory backend (default: auto)")
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("stats", help="pool usage and sessions")
    p.add_argument("--socket-dir")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true", help="a live table, refreshed every --interval s")
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--count", type=int, help="with --watch: stop after this many tables")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("status", help="version, uptime, backend, pools, sessions")
    p.add_argument("--socket-dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("trim", help="give a pool's freed memory back to the system")
    p.add_argument("pool")
    p.add_argument("--keep", type=int, default=0, help="bytes to keep reserved")
    p.add_argument("--socket-dir")
    p.set_defaults(func=cmd_trim)

    p = sub.add_parser("ls", help="named objects: name, size, dtype, shape, state, leases")
    p.add_argument("prefix", nargs="?", default="")
    p.add_argument("--socket-dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("rm", help="delete named objects (freed once no lease holds them)")
    p.add_argument("names", nargs="+")
    p.add_argument("--socket-dir")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("load", help="stream a safetensors file into sealed named objects")
    p.add_argument("file")
    p.add_argument("--prefix", default="")
    p.add_argument("--pool", default="default")
    p.add_argument("--socket-dir")
    p.set_defaults(func=cmd_load)

    p = sub.add_parser("demo", help="a producer process and a consumer process share memory")
    p.add_argument("--socket-dir")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("doctor", help="which backend would be chosen, and why")
    p.add_argument("--backend", choices=backends.BACKENDS)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
    return parser


# syslog priorities, which journald reads from a "<N>" prefix on each line.
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).replace("\n", " | ")   # one line per event
        return f"<{_PRIORITY.get(record.levelno, 6)}>{text}"


def configure_logging(level: str) -> None:
    """One line per event on stderr: under systemd (journald) with a priority prefix and no
    timestamp (the journal keeps its own); elsewhere with a timestamp and the level."""
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.func(args)
    except IpcPoolError as exc:
        print(f"ipcpool {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
