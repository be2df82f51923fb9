"""The one module that imports NIXL (``pip install --no-deps nixl-cu13``, or nixl-cu12)."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import MissingDependency

MODULES = ("nixl_cu13", "nixl_cu12", "nixl")   # the CUDA 13 and 12 wheels, then a source build


def load() -> Any:
    """The NIXL module, or MissingDependency saying how to install it."""
    import importlib

    raise_exceptions = logging.raiseExceptions
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        # NIXL's Python package sends its records to stdout through a handler of its own and
        # changes logging.raiseExceptions: its records go through the application's logging.
        logging.raiseExceptions = raise_exceptions
        nixl_log = logging.getLogger("nixl")
        nixl_log.handlers.clear()
        nixl_log.propagate = True
        nixl_log.setLevel(logging.WARNING)
        return module
    raise MissingDependency("pulling from a peer needs NIXL: pip install --no-deps 'nixl-cu13==1.5.1' "
                            "(or pip install 'ipcpool[nixl]', which also brings torch)")


def available() -> bool:
    try:
        load()
    except MissingDependency:
        return False
    return True


def memory_type(on_gpu: bool) -> str:
    return "VRAM" if on_gpu else "DRAM"


# UCX (1.19) reads GPU memory of another process through CUDA IPC only where it detects NVLink;
# elsewhere (one GPU, or GPUs on PCIe) a READ of GPU memory falls to its TCP emulation, hundreds of
# times slower. A pull is a READ: allow CUDA IPC for it unless the operator said otherwise.
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def agent(name: str, port: int, gpu: bool) -> Any:
    """A NIXL agent on UCX whose listener (metadata exchange) is on ``port`` (0: any free one).
    UCX reads its settings from the environment as the agent is made: for an agent that moves GPU
    memory (``gpu``) ``UCX_DEFAULTS`` are put there for that moment where the operator has not set
    them (elsewhere UCX would warn that nothing uses them)."""
    nixl = load()
    config = nixl.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=True, listen_port=port,
                                    backends=["UCX"])
    added = [key for key in UCX_DEFAULTS if gpu and key not in os.environ]
    os.environ.update({key: UCX_DEFAULTS[key] for key in added})
    try:
        made = nixl.nixl_agent(name, config)
    finally:
        for key in added:
            os.environ.pop(key, None)
    if "UCX" not in made.backends:
        raise MissingDependency(f"NIXL has no UCX backend here (plugins: {', '.join(made.plugin_list) or 'none'})")
    return made


def backend_error() -> Exception:
    """The error NIXL raises where no backend registers the memory (NIXL_ERR_BACKEND), as for GPU
    memory when UCX has no CUDA support: for the test hook that stands in for that."""
    import importlib

    return importlib.import_module(f"{load().__name__}._bindings").nixlBackendError("NIXL_ERR_BACKEND")
