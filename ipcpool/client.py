"""``from .client import connect``, as ``cli.py`` imports it; the client lives in ``ipcpool._client``."""

from ._client.client import connect

__all__ = ["connect"]
