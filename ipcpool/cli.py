"""`ipcpool ...`: broker, stats, ls, rm, load, demo, doctor. The only place that configures logging."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import backend as backends
from .errors import IpcPoolError

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
    broker.start()
    try:
        broker.serve_forever()
    finally:
        broker.close()
    return 0


def cmd_stats(args) -> int:
    from .client import connect

    with connect(args.socket_dir) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"backend {stats['backend']}  sessions {stats['sessions']}  pid {stats['pid']}")
    cols = ("reserved", "used", "reserved_high", "used_high")
    print(f"{'pool':<16}" + "".join(f"{c:>16}" for c in cols) + f"{'allocations':>13}")
    for name, s in stats["pools"].items():
        print(f"{name:<16}" + "".join(f"{_human(s[c]):>16}" for c in cols) + f"{s['allocations']:>13}")
    return 0


def cmd_ls(args) -> int:
    from .client import connect

    with connect(args.socket_dir) as client:
        objects = client.list(args.prefix)
    if args.json:
        print(json.dumps(objects, indent=2))
        return 0
    rows = [("NAME", "SIZE", "DTYPE", "SHAPE", "STATE", "LEASES")]
    for o in objects:
        shape = o["meta"].get("shape")
        rows.append((o["name"], _human(o["size"]), o["meta"].get("dtype") or "-",
                     "x".join(map(str, shape)) if shape is not None else "-", o["state"], str(o["leases"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i in (0, 2, 3, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"{len(objects)} object(s), {_human(sum(o['size'] for o in objects))}")
    return 0


def cmd_rm(args) -> int:
    from .client import connect

    failed = 0
    with connect(args.socket_dir) as client:
        for name in args.names:
            try:
                client.delete(name)
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
    p.set_defaults(func=cmd_stats)

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except IpcPoolError as exc:
        print(f"ipcpool {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
