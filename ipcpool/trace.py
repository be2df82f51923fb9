"""Named events from inside ipcpool to one callback per process: how a diagnostic sees where a
hand-off's or an attach's time goes without patching private methods.

The callback is called as ``callback(name, info)``, ``info`` a dict of the event's fields, in the
thread that emits it, at the moment of the event (the callback takes its own timestamp:
``time.perf_counter_ns()`` is CLOCK_MONOTONIC, one clock for every process of the machine).
Keep it short and never call ipcpool from it: it runs on the hot path, under the locks the
emitting code holds. ``info`` and the objects in it are ipcpool's: read them, keep copies.

Subscribing:

- in a client's process: ``set_trace(callback)`` (None: unsubscribe), or ``with tracing(callback):``;
- in the broker's: ``IPCPOOL_TRACE=module:function`` in the environment of ``ipcpool broker``,
  which imports ``module`` (from its ``sys.path``: set ``PYTHONPATH`` where it lies elsewhere) at
  start and subscribes ``function``. What it gathers, it writes where it likes (at exit:
  ``atexit``; the broker exits normally on SIGTERM). Whoever sets a broker's environment can
  run code in it anyway: the variable opens nothing new.

A callback that raises is unsubscribed, its error logged once: the operation traced goes on as
if it were not traced, and a diagnostic's bug never fails a worker's request or the broker's.

Emitting, on a path measured in microseconds: the module attribute is checked before anything is
built, so an event nobody listens to costs one attribute check (6 ns, 2 more than an empty
statement, ``timeit`` on CPython 3.11; calling ``emit`` unguarded with three fields costs 70)::

    if trace.hook is not None:
        trace.emit("client.seal_sent", name=name, rid=rid, framed=True)

Events (``name``: fields; where):

- ``client.create_sent``: op (create or allocate), name, rid, framed (a control-socket frame,
  else a message). A carved create left the writer, no reply awaited (``_client/handoff``).
- ``client.seal_posted``: name. A carved object's seal recorded and its board word posted: its
  readers may go on from here (``_client/handoff``).
- ``client.seal_sent``: name, rid, framed. Its seal left (``_client/handoff``).
- ``client.entry_found``: name. A directory reader found the object's entry (``_client/handoff``).
- ``client.seal_seen``, ``client.ordered``: name. It saw the object sealed (its board word or
  entry), then has its stream (or the host) ordered after the seal.
- ``client.wait``: rid. A caller starts waiting for the reply to request ``rid``
  (``Channel.wait_reply``).
- ``client.received``: nbytes. A message from the broker taken off the message channel, not yet
  decoded (``Channel._take_reply``).
- ``client.decoded``: msg. That message decoded (a reply, a notice or a late error).
- ``client.pool_import``, ``client.pool_imported``: pool. A pool imported on its first use: its
  FDs asked for, the pool and its board mapped (``Pools.get``).
- ``client.views``: count, kind. Leases about to become typed arrays or tensors (``typed_many``).
- ``broker.request``: op, fields, sid. A request of either channel, checked, about to be handled
  (``Broker._run``; ``fields`` as the handler gets them).
- ``broker.handled``: op, sid, reply. Its handler returned (``reply``: None where it is answered
  later, as a get waiting for a seal).
- ``broker.reply``: op, rid, reply, sid. A request's answer leaving, when its handler returned
  one (``Broker._reply``).
- ``broker.send``: ident, msg. Any other message to a client: a later answer (a waiting reader's
  pending lease), a notice, an error reply (``Broker.send``).
- ``broker.entry``: pool, name, index. A new object's name-directory entry written, the first
  thing done with its create (``Directories.publish``). (A traced broker checks every create in
  Python, so that these come in this order: untraced, the usual create is checked up to its entry
  in C, ``ObjectTable.create_usual``.)
- ``client.phase``: phase, at ("start" or "end"), args (the call's positional arguments, self
  first). A step of a checkpoint writer's round began or ended, whatever its outcome (functions
  marked ``@phase``): ``begin``, ``import`` (``Pools.import_allocation``), ``let_go``, ``views``
  (``VersionWriter.tensors``), ``copy`` (``weights.modules._copy_all``), ``publish``, ``release``
  and ``keep`` (``Handoff``), ``call`` (``Channel.call``: ``args[1]`` is the op) and ``control``
  (``Channel.control_call``). A step may hold others (``begin`` holds ``import`` and ``call``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from .errors import ConfigError

log = logging.getLogger(__name__)

ENV = "IPCPOOL_TRACE"

Callback = Callable[[str, dict[str, Any]], object]

# The subscriber, or None. Read at every emission point (``trace.hook``): a module attribute, not
# a function, because a call costs more than the whole check.
hook: Callback | None = None


def emit(event: str, /, **info: Any) -> None:
    """Deliver ``event`` with ``info`` to the subscriber, if any (``event`` is positional: ``name``
    is a field of several events)."""
    global hook
    callback = hook
    if callback is None:
        return
    try:
        callback(event, info)
    except Exception:
        if hook is callback:   # (not one subscribed meanwhile by another thread)
            hook = None
        log.exception("the trace callback %r failed on %r and is unsubscribed", callback, event)


def phase(name: str) -> Callable[[Callable], Callable]:
    """Mark a function as step ``name``: ``client.phase`` at its start and end while someone
    listens. Untraced it costs a call and one check: for steps of milliseconds, and the few of a
    hand-off whose microsecond is worth a writer's round being seen whole."""
    def mark(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            if hook is None:
                return fn(*args, **kwargs)
            emit("client.phase", phase=name, at="start", args=args)
            try:
                return fn(*args, **kwargs)
            finally:
                emit("client.phase", phase=name, at="end", args=args)
        return step
    return mark


def set_trace(callback: Callback | None) -> Callback | None:
    """Subscribe ``callback`` for this process (None: nobody); the one it replaces."""
    global hook
    previous, hook = hook, callback
    return previous


@contextlib.contextmanager
def tracing(callback: Callback) -> Iterator[Callback]:
    """``callback`` subscribed within the block; whoever was before, again after it."""
    previous = set_trace(callback)
    try:
        yield callback
    finally:
        set_trace(previous)


def from_environment(environ: dict[str, str] | None = None) -> Callback | None:
    """Subscribe the callback ``$IPCPOOL_TRACE`` names (``module:function``); it, or None where
    the variable is unset or empty. A name that does not resolve is a ConfigError: whoever set
    it expects events."""
    spec = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not spec:
        return None
    module_name, _, attr = spec.partition(":")
    try:
        callback = getattr(importlib.import_module(module_name), attr) if attr else None
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{ENV}={spec!r}: cannot load the trace callback: {exc}") from exc
    if not callable(callback):
        raise ConfigError(f"{ENV}={spec!r}: expected module:function naming a callable")
    set_trace(callback)
    log.info("trace events go to %s", spec)
    return callback
