"""``ipcpool serve-peer`` and ``ipcpool pull``: the fleet commands, reading [nixl] and [peers]
from the broker's configuration file."""

from __future__ import annotations

import signal
import sys

from ..errors import InvalidRequest


def split_version(text: str) -> tuple[str, int | None]:
    """``NAME`` or ``NAME@VERSION``."""
    name, at, number = text.rpartition("@")
    if not at:
        return text, None
    if not name or not number.isdigit():
        raise InvalidRequest(f"{text!r}: expected CHECKPOINT or CHECKPOINT@VERSION (a number)")
    return name, int(number)


def cmd_serve_peer(args) -> int:
    from .._client.client import connect
    from .pull import fleet_of
    from .serve import PeerServer

    fleet = fleet_of(args.config)
    with connect(args.socket_dir) as client:
        server = PeerServer(client, fleet)
        # The handler only asks the loop to stop; the loop lets go of what it serves.
        signal.signal(signal.SIGTERM, lambda *_: server.stop.set())
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.close()
    return 0


def cmd_pull(args) -> int:
    from .._client.client import connect
    from .pull import pull

    name, version = split_version(args.checkpoint)
    with connect(args.socket_dir) as client:
        result = pull(client, args.peer, name, version=version, config=args.config, local_name=args.name,
                      pool=args.pool, timeout=args.timeout, progress=True)
    print(result.summary())
    if result.warning:
        print(f"ipcpool pull: warning: {result.warning}", file=sys.stderr)
    return 0
