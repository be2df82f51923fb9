"""Helpers the tests share (no test lives here; a test module imports from here, never from
another test module). The broker fixtures themselves are in tests/conftest.py.

- ``broker``: ``BrokerProc``, a broker in its own process as ``ipcpool broker`` runs it
- ``procs``: ``SPAWN``, ``run_together``, ``run_procs`` (client code in spawned processes)
- ``fds``: ``is_open``, ``fd_count``
- ``fdstore``: systemd's FD store and ``LISTEN_FDS``, reduced to what durable memory needs
- ``cli``: the ``ipcpool`` command as an operator runs it, and the tables it prints
- ``raw``: a control socket and a session opened by hand, below the client library
- ``counting``: the requests a client sends, by op
- ``gpu``, ``kernels``: the two-GPU marker, torch client processes, cupy kernels (GPU tests)
"""
