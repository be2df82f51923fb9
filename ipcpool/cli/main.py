"""`ipcpool ...`: broker, status, stats, sessions, trim, ls, rm, load, serve-peer, pull, demo,
doctor. The only place that configures logging. Tables are drawn with rich; every byte count goes
through ``sizes.format_size``.

Exit status: 0 done; 1 the command ran and the answer is no (``rm`` of a name that is not there,
``demo`` failed, ``doctor``: the backend cannot run here); 2 an error (no broker, refused, a bad
config or argument); 130 Ctrl-C; 141 its output pipe closed (``| head``), quietly."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from .. import backend as backends
from .._version import __version__
from ..errors import IpcPoolError, ObjectNotFound
from ..sizes import format_size, parse_size

log = logging.getLogger("ipcpool")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SOCKET_DIR_HELP = ("the broker's socket directory (default: $IPCPOOL_SOCKET_DIR, else /run/ipcpool where the "
                   "system service runs, else $XDG_RUNTIME_DIR/ipcpool, else a per-user temporary directory)")


# -- output ----------------------------------------------------------------------------------------
def _console(stream=None, width: int = 200):
    from rich.console import Console

    stream = stream or sys.stdout
    # Wide enough that a pipe or a log never gets a wrapped table (a terminal uses its own width).
    return Console(file=stream, markup=False, highlight=False, emoji=False,
                   width=None if stream.isatty() else width)


def _table(*columns: str, left: int = 1):
    """A rich table: the first ``left`` columns left-aligned (names), the rest right (numbers)."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i < left else "right", no_wrap=i < left)
    return table


def _stats_view(stats: dict):
    from rich.console import Group
    from rich.text import Text

    # Short headers: eight columns of sizes up to "1023.9 MiB" fit 80 columns.
    cols = {"reserved": "reserved", "used": "used", "reserved_high": "res_high", "used_high": "used_high",
            "arena_free": "arena_free", "growable_bytes": "growable"}
    table = _table("pool", *cols.values(), "allocs")
    table.collapse_padding = True
    for name, s in stats["pools"].items():
        table.add_row(name, *(format_size(s.get(c, 0)) for c in cols), str(s["allocations"]))
    head = Text(f"{time.strftime('%H:%M:%S')}  backend {stats['backend']}  sessions {stats['sessions']}  "
                f"objects {stats.get('objects', 0)}  pid {stats['pid']}")
    return Group(head, table)


# -- commands --------------------------------------------------------------------------------------
def cmd_broker(args) -> int:
    from .. import trace
    from ..broker import Broker
    from ..config import load

    if args.print_config:
        print(_config_template(), end="")
        return 0
    config = load(args.config)
    choice = backends.choose(args.backend or (config.backend if config.backend != "auto" else None))
    trace.from_environment()   # a diagnostic's callback ($IPCPOOL_TRACE), before anything happens
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


def _config_template() -> str:
    """The documented config (every key), shipped inside the package: a wheel has no deploy/."""
    from importlib.resources import files

    return files("ipcpool").joinpath("config_template.toml").read_text(encoding="utf-8")


def cmd_stats(args) -> int:
    from .._client.client import connect

    with connect(args.socket_dir) as client:
        if args.json:
            print(json.dumps(client.stats(), indent=2))
            return 0
        console = _console(width=80)
        if not args.watch:
            console.print(_stats_view(client.stats()))
            return 0
        shown = 0
        if console.is_terminal:   # redrawn in place
            from rich.live import Live

            with Live(_stats_view(client.stats()), console=console, auto_refresh=False) as live:
                shown = 1
                while args.count is None or shown < args.count:
                    time.sleep(args.interval)
                    live.update(_stats_view(client.stats()), refresh=True)
                    shown += 1
            return 0
        while args.count is None or shown < args.count:   # a log or a pipe: one table after another
            console.print(_stats_view(client.stats()))
            shown += 1
            if args.count is None or shown < args.count:
                time.sleep(args.interval)
    return 0


def cmd_status(args) -> int:
    from .._client.client import connect

    with connect(args.socket_dir) as client:
        s = client.stats()
    if args.json:   # what the broker is and whether it is up; `stats --json` has every figure
        pools = {name: {k: p[k] for k in ("used", "reserved", "allocations")} for name, p in s["pools"].items()}
        print(json.dumps({k: s[k] for k in ("version", "pid", "uptime", "backend", "sessions", "objects")}
                         | {"socket_dir": str(client.socket_dir), "pools": pools}, indent=2))
        return 0
    up = int(s["uptime"])
    console = _console()
    console.print(f"ipcpool {s['version']}  pid {s['pid']}  up {up // 3600}h{up % 3600 // 60:02d}m{up % 60:02d}s")
    console.print(f"backend {s['backend']}  sessions {s['sessions']}  objects {s['objects']}  "
                  f"socket dir {client.socket_dir}")
    table = _table("pool", "used", "reserved", "allocations")
    for name, p in s["pools"].items():
        table.add_row(name, format_size(p["used"]), format_size(p["reserved"]), str(p["allocations"]))
    console.print(table)
    return 0


def cmd_trim(args) -> int:
    from .._client.client import connect

    with connect(args.socket_dir) as client:
        before = client.stats()["pools"].get(args.pool, {}).get("reserved", 0)
        client.trim(args.pool, args.keep)
        after = client.stats()["pools"][args.pool]["reserved"]
    print(f"pool {args.pool}: reserved {format_size(before)} -> {format_size(after)}")
    return 0


def cmd_ls(args) -> int:
    from .._client.client import connect

    with connect(args.socket_dir) as client:
        objects = client.list(args.prefix)
        growables = client.list_growables(args.prefix)
        checkpoints = client.list_checkpoints(args.prefix)
    if args.json:
        print(json.dumps({"objects": objects, "growables": growables, "checkpoints": checkpoints}, indent=2))
        return 0
    console = _console()
    table = _table("NAME", "SIZE", "DTYPE", "SHAPE", "STATE", "LEASES")
    for o in objects:
        shape = o["meta"].get("shape")
        table.add_row(o["name"], format_size(o["size"]), o["meta"].get("dtype") or "-",
                      "x".join(map(str, shape)) if shape is not None else "-", o["state"], str(o["leases"]))
    if objects:
        console.print(table)
    console.print(f"{len(objects)} object(s), {format_size(sum(o['size'] for o in objects))}")
    if growables:
        console.print()
        table = _table("GROWABLE", "SIZE", "CHUNKS", "POOL", "STATE", "ATTACHED")
        for g in growables:
            table.add_row(g["name"], format_size(g["size"]), str(g["chunks"]), g["pool"], g["state"], str(g["attached"]))
        console.print(table)
        console.print(f"{len(growables)} growable buffer(s), {format_size(sum(g['size'] for g in growables))}")
    if checkpoints:
        console.print()
        table = _table("CHECKPOINT", "VERSION", "STATE", "TENSORS", "SIZE", "SHARDS", "HOLDERS")
        for row in _checkpoint_rows(checkpoints):
            table.add_row(*row)
        console.print(table)
        console.print(f"{len(checkpoints)} checkpoint(s)")
    return 0


def _checkpoint_rows(checkpoints: list[dict]) -> list[tuple[str, ...]]:
    """One row per live version: name, version, state, tensors, size, shards, holders; and one
    per spare (memory kept for the next version, state "spare")."""
    rows = []
    for c in checkpoints:
        rows += [(c["name"], str(v["version"]), v["state"], str(v["tensors"]), format_size(v["size"]),
                  str(v["shards"]), str(v["holders"])) for v in c["versions"]]
        if c.get("spare"):
            rows.append((c["name"], "-", "spare", "-", format_size(c["spare"]), "-", "0"))
    return rows


def cmd_sessions(args) -> int:
    from .._client.client import connect

    with connect(args.socket_dir) as client:
        rows = client.sessions()
        mine = client.session
    for r in rows:   # the process behind each, where this process may see it
        r["user"], r["command"] = _user(r["uid"]), _command(r["pid"])
        r["self"] = r["session"] == mine
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = _table("SESSION", "PID", "USER", "COMMAND", "BYTES", "ALLOCS", "LEASES", "WRITING", "GROWABLES",
                   "STATE", left=4)
    for r in rows:
        table.add_row(str(r["session"]) + ("*" if r["self"] else ""), str(r["pid"]), r["user"], r["command"],
                      format_size(r["bytes"]), str(r["allocations"]), str(r["leases"]), str(r["writing"]),
                      str(r["growables"]), r["state"])
    console = _console()
    console.print(table)
    console.print(f"{len(rows)} session(s), {format_size(sum(r['bytes'] for r in rows))} held "
                  "(* this command's own)")
    return 0


def _user(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "-"
    except OSError:   # gone, or hidden from us (another pid namespace, hidepid)
        return "-"


def cmd_rm(args) -> int:
    from .._client.client import connect

    if not args.names and args.prefix is None:
        raise IpcPoolError("name what to remove: NAME..., or --prefix PREFIX")
    if args.prefix == "":
        raise IpcPoolError("--prefix '' would remove every object; give at least one character")
    failed = 0
    with connect(args.socket_dir) as client:
        if args.prefix is not None:
            failed += _rm_prefix(client, args.prefix)
        for name in args.names:
            try:
                try:
                    client.delete(name)
                except ObjectNotFound:   # not an object: a growable buffer of that name?
                    try:
                        client.delete_growable(name)
                    except ObjectNotFound:   # a checkpoint, then (every version, as one)
                        try:
                            client.delete_checkpoint(name)
                        except ObjectNotFound:
                            raise ObjectNotFound(f"no object, growable buffer or checkpoint named {name!r}") from None
            except IpcPoolError as exc:
                print(f"ipcpool rm: {name}: {exc}", file=sys.stderr)
                failed += 1
    return 1 if failed else 0


def _rm_prefix(client, prefix: str) -> int:
    """Every object and growable buffer under ``prefix``; how many could not be removed."""
    failed = removed = 0
    for what, names, delete in (
            ("object", [o["name"] for o in client.list(prefix)], client.delete),
            ("growable buffer", [g["name"] for g in client.list_growables(prefix)], client.delete_growable)):
        for name in names:
            try:
                delete(name)
                removed += 1
            except ObjectNotFound:   # removed by someone else meanwhile: gone all the same
                pass
            except IpcPoolError as exc:
                print(f"ipcpool rm: {name}: {exc}", file=sys.stderr)
                failed += 1
    if not removed and not failed:
        print(f"ipcpool rm: nothing is named {prefix}...", file=sys.stderr)
        return 1
    print(f"removed {removed} name(s) under {prefix}")
    return failed


def cmd_load(args) -> int:
    from .load import cmd_load

    return cmd_load(args)


def cmd_serve_peer(args) -> int:
    from ..fleet.command import cmd_serve_peer

    return cmd_serve_peer(args)


def cmd_pull(args) -> int:
    from ..fleet.command import cmd_pull

    return cmd_pull(args)


def cmd_demo(args) -> int:
    from .demo import run

    return 0 if run(args.socket_dir, backend=args.backend, private=args.private) else 1


def cmd_doctor(args) -> int:
    from .doctor import lines, report

    rep, usable = report(args.backend, args.socket_dir)
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print("\n".join(lines(rep)))
    return 0 if usable else 1


# -- arguments -------------------------------------------------------------------------------------
def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _level_arg(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"one of {', '.join(LOG_LEVELS)} (any case), not {text!r}")
    return level


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ipcpool", description="Share GPU and host memory between processes through a broker daemon.",
        epilog="`ipcpool COMMAND --help` explains each command's options.")
    parser.add_argument("--version", action="version", version=f"ipcpool {__version__}",
                        help="print the version and exit")
    level_help = "log threshold on stderr: debug, info, warning or error (default: info)"
    parser.add_argument("--log-level", type=_level_arg, default="INFO", metavar="LEVEL", help=level_help)
    # Accepted after the command too (`ipcpool broker --log-level debug`): SUPPRESS keeps the
    # value given before the command when none is given after it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", type=_level_arg, default=argparse.SUPPRESS, metavar="LEVEL", help=level_help)
    connecting = argparse.ArgumentParser(add_help=False, parents=[common])
    connecting.add_argument("--socket-dir", metavar="DIR", help=SOCKET_DIR_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, func, parent=connecting) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", parents=[parent])
        p.set_defaults(func=func)
        return p

    backend_help = "memory backend: auto (CUDA where a driver and a GPU answer, else host), host or cuda"
    p = add("broker", "run the broker in the foreground; SIGTERM or Ctrl-C stops it", cmd_broker)
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (--print-config shows every key)")
    p.add_argument("--print-config", action="store_true",
                   help="print the documented configuration file (every key, its default) and exit")
    p.add_argument("--backend", choices=backends.BACKENDS,
                   help=backend_help + " (default: the config's backend, else $IPCPOOL_BACKEND, else auto)")

    p = add("status", "version, uptime, backend, pools and sessions of the running broker", cmd_status)
    p.add_argument("--json", action="store_true", help="print the broker's full stats as JSON")

    p = add("stats", "per-pool memory (reserved, used, their high marks, arena_free, growable_bytes) and sessions", cmd_stats)
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    p.add_argument("--watch", action="store_true", help="keep showing the table, refreshed every --interval seconds")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="with --watch: seconds between tables (default: 1)")
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N tables (default: until Ctrl-C)")

    p = add("sessions", "open sessions: the process (pid, user, command) and what each holds", cmd_sessions)
    p.add_argument("--json", action="store_true", help="print the sessions as JSON")

    p = add("trim", "give a pool's freed memory back to the system", cmd_trim)
    p.add_argument("pool", help="the pool's name, as in `ipcpool stats`")
    p.add_argument("--keep", type=_size_arg, default=0, metavar="SIZE",
                   help="memory to keep reserved: bytes or a size such as 512M, 1G (default: 0)")

    p = add("ls", "named objects (name, size, dtype, shape, state, leases), then growable buffers", cmd_ls)
    p.add_argument("prefix", nargs="?", default="", help="list only names that start with PREFIX (default: all)")
    p.add_argument("--json", action="store_true", help="print objects and growable buffers as JSON")

    p = add("rm", "delete named objects or growable buffers (freed once nothing holds them)", cmd_rm)
    p.add_argument("names", nargs="*", metavar="NAME", help="an object's or growable buffer's name")
    p.add_argument("--prefix", metavar="PREFIX",
                   help="also delete every object and growable buffer whose name starts with PREFIX")

    p = add("load", "publish a safetensors file, or a directory of them (model.safetensors.index.json), "
                    "as one checkpoint version", cmd_load)
    p.add_argument("file", metavar="PATH", help="a .safetensors file or a directory of them")
    p.add_argument("--name", help="the checkpoint's name (default: the file's stem or the directory's name)")
    p.add_argument("--prefix", default=None,
                   help="instead: one sealed object per tensor, named PREFIX + its name (for example m/)")
    p.add_argument("--pool", default="default", help="the pool to load into (default: default)")
    p.add_argument("--overwrite", action="store_true",
                   help="with --prefix: delete an object of the same name first (readers that hold it keep "
                        "their lease)")

    config_help = ("the broker's TOML configuration, for its [nixl] and [peers] (default: $IPCPOOL_CONFIG, "
                   "else /etc/ipcpool/broker.toml where it exists)")
    p = add("serve-peer", "let the peers named in the configuration pull checkpoints from this node's broker "
                          "through NIXL (a client of the broker; runs until SIGTERM or Ctrl-C)", cmd_serve_peer)
    p.add_argument("--config", metavar="FILE", help=config_help)

    p = add("pull", "pull a checkpoint from a peer node's broker through NIXL into a new version here, "
                    "published once every tensor's digest checks", cmd_pull)
    p.add_argument("peer", metavar="PEER", help="a peer's name under [peers] in the configuration")
    p.add_argument("checkpoint", metavar="CHECKPOINT[@VERSION]", help="the peer's checkpoint (default: its current version)")
    p.add_argument("--name", help="the local checkpoint's name (default: the same)")
    p.add_argument("--pool", default="default", help="the pool to pull into (default: default)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="for the peer's metadata and its answer (default: 60)")
    p.add_argument("--config", metavar="FILE", help=config_help)

    p = add("demo", "a producer process writes into broker memory, a consumer process checks it zero-copy; "
                    "starts a private broker where none is running", cmd_demo)
    p.add_argument("--private", action="store_true",
                   help="always use a private broker in a temporary directory, even where one is running")
    p.add_argument("--backend", choices=backends.BACKENDS, help=backend_help + ", for a private broker")

    p = add("doctor", "which backend the broker would choose here and why; the GPU's capabilities; MPS; "
                      "whether a broker answers", cmd_doctor)
    p.add_argument("--backend", choices=backends.BACKENDS, help="check this backend (default: as the broker would)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (always JSON, GPU or not)")
    return parser


# -- logging ---------------------------------------------------------------------------------------
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


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _fail(args, exc: BaseException, text: str) -> int:
    """An error: one line on stderr, or with --json a JSON object on stdout (where the caller reads)."""
    if getattr(args, "json", False):
        print(json.dumps({"error": text, "type": type(exc).__name__, "code": getattr(exc, "code", None)}))
    else:
        print(f"ipcpool {args.command}: {text}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args: Any = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        try:
            code = args.func(args)
            sys.stdout.flush()   # a closed pipe shows here, not at exit
            return code
        except IpcPoolError as exc:
            return _fail(args, exc, _one_line(exc))
        except BrokenPipeError:
            raise
        except OSError as exc:    # a file named on the command line: missing, unreadable
            where = f"{exc.filename}: " if exc.filename else ""
            return _fail(args, exc, f"{where}{exc.strerror or _one_line(exc)}")
        except KeyboardInterrupt:
            return 130
    except BrokenPipeError:   # `ipcpool ls | head`: the reader has all it wanted
        # Python would flush stdout again at exit and complain: point it at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
