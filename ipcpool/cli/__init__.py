"""The ``ipcpool`` command (the console script and ``python -m ipcpool``): nothing of the library
imports it; it stands above the broker, the client, weights and fleet.

    main     the parser, logging set-up, and every command that fits in a few lines
    load     ``ipcpool load``: a file into a checkpoint version, or into sealed objects
    demo     ``ipcpool demo``: a producer writes broker memory, a consumer opens it zero-copy
    doctor   ``ipcpool doctor``: what the backend can do here, and whether a broker answers

``ipcpool serve-peer`` and ``ipcpool pull`` live with the fleet (``ipcpool.fleet.command``).
"""

from .main import main

__all__ = ["main"]
