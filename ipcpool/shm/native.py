"""Which of the hand-off's hot calls run in C (``_native.c``, where the package was built with a
compiler): the reader's directory lookup and state check (``directory``), and the three in one
with its hazard slot (``leases``), the writer's ring puts
(``requests``: the seal's with its record and post) and its seal's record and post (``sealboard``). Each module falls back to its Python
where the C part is absent, or switched off here: the switch is for measurements that compare the
two in one process (``bench/handoff.py --reader-ab``, ``--writer-ab``)."""

from __future__ import annotations

from . import directory, leases, requests, sealboard

_CALLS = {"reader": ((directory, "_native_lookup"), (directory, "_native_state"), (leases, "native_take")),
          "writer": ((requests, "put_ready"), (requests, "put_sealed"), (sealboard, "_native_record_post"))}
_BUILT = {side: tuple(getattr(module, name) for module, name in calls) for side, calls in _CALLS.items()}


def built(side: str) -> bool:
    """Whether ``side``'s ("reader" or "writer") calls are in C here."""
    return None not in _BUILT[side]


def use(side: str, on: bool) -> None:
    """Run ``side``'s calls in C (``on``, where built) or in Python, from now on in this process."""
    for (module, name), call in zip(_CALLS[side], _BUILT[side]):
        setattr(module, name, call if on else None)
