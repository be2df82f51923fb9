"""The broker daemon: sessions, the registry of pools and allocations, and the event loop."""

from .server import Broker

__all__ = ["Broker"]
