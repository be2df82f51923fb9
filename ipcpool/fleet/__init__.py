"""Beyond one node: a peer's checkpoint pulled through NIXL into this node's broker.

``ipcpool serve-peer`` (``serve``) runs beside a broker as one of its clients and lets the peers
named in ``broker.toml`` read checkpoint versions through NIXL; ``ipcpool pull`` (``pull``)
makes a new local version, has NIXL read every tensor straight into it, checks a digest per
tensor and publishes it only then. NIXL is loaded by these alone (``nixl``): never by the broker,
never by a client that does not pull. docs/fleet.md says what crosses the node boundary.
"""

from .pull import PullResult, fleet_of, pull

__all__ = ["PullResult", "fleet_of", "pull"]
