"""The libraries ipcpool works with but does not depend on (torch, CuPy, numpy): imported only
when used, and where one is missing, an error that says what to install instead."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import MissingDependency

_INSTEAD = {
    "torch": "pip install 'ipcpool[torch]' (or torch itself), or read it as an array with get_array() "
             "(numpy on the host backend, CuPy on CUDA) or np.asarray(buf)",
    "cupy": "pip install 'ipcpool[cupy]' (or the cupy-cuda* wheel for your CUDA), or use get_tensor() with torch",
    "numpy": "pip install numpy",
}


def require(module: str) -> Any:
    """``module``, imported; where it is not installed, ``MissingDependency`` saying what to install
    instead of a bare ModuleNotFoundError."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name not in (module, None):   # the library is there but one of its own imports failed
            raise
        raise MissingDependency(f"{module} is not installed: {_INSTEAD[module]}") from exc
