"""The broker daemon: sessions, the registry of pools and allocations, and the event loop.

Words used here, one meaning each:

- free: a holder lets go of an allocation (the ``free`` op); its memory goes back to the pool
  after the last holder (``Registry.unhold``).
- destroy: a growable buffer's memory goes (it was deleted and nobody holds it any more).
- retire: an arena goes, once its session is gone and no range of it is in use.
- end: a session is over (bye, or its process is gone); it lets go of everything it held.
- restore: take back what a previous broker left in systemd's FD store (pools, growable
  buffers, sealed objects); the backend's methods for it keep the name ``adopt_*``.
- release: only in ``release_threshold``, the memory pool's own term (how much freed memory it
  keeps before giving it back to the system). Log messages keep their words.
"""

from .server import Broker

__all__ = ["Broker"]
