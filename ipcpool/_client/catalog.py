"""Finding what the broker holds: names listed page by page, and ``Subscription``, the objects
sealed under a prefix as they are sealed (the broker's notices, queued by the channel)."""

from __future__ import annotations

import collections

from .channel import Channel


def list_all(channel: Channel, prefix: str, kind: str, after: str = "") -> list[dict]:
    """Every entry of ``kind`` ("objects", "growables") under ``prefix`` after ``after``, a page
    per request."""
    out: list[dict] = []
    while True:
        reply = channel.call("list", prefix=prefix, after=after, kind=kind)
        out += reply[kind]
        if not reply.get("more") or not isinstance(reply.get("after"), str) or reply["after"] <= after:
            return out
        after = reply["after"]


def subscribe(channel: Channel, prefix: str, existing: bool) -> Subscription:
    """A watch on ``prefix``: each seal announced from now on (and, with ``existing``, the
    objects sealed already, first)."""
    with channel.lock:
        reply = channel.call("watch", prefix=prefix, existing=existing)
        queue = channel.watches[reply["watch"]] = collections.deque()
        channel.watch_prefixes[reply["watch"]] = prefix
        listed = list(reply["existing"])
        if reply.get("more") and isinstance(reply.get("after"), str):
            # The rest page by page. Seals announced meanwhile are queued already: an object
            # listed here as well is kept once.
            listed += [o for o in list_all(channel, prefix, "objects", reply["after"]) if o.get("state") == "sealed"]
            seen = {(o["name"], o.get("created")) for o in listed}
            announced = [o for o in queue if (o.get("name"), o.get("created")) not in seen]
            queue.clear()
            queue.extend(announced)
        queue.extendleft(reversed(listed))
        return Subscription(channel, reply["watch"], prefix, queue)


class Subscription:
    """Objects sealed under a prefix, as they are sealed: ``for info in sub`` or ``sub.next(t)``."""

    def __init__(self, channel: Channel, wid: int, prefix: str, queue: collections.deque):
        self._channel = channel
        self.wid = wid
        self.prefix = prefix
        self._queue = queue

    def next(self, timeout: float | None = None) -> dict | None:
        """The next sealed object's info (name, size, meta, ...), or None after ``timeout`` s."""
        return self._channel.next_watched(self.wid, timeout)

    def __iter__(self):
        while True:
            yield self.next()

    def close(self) -> None:
        channel = self._channel
        channel.watch_prefixes.pop(self.wid, None)
        if channel.watches.pop(self.wid, None) is not None and not channel.closed:
            channel.call("unwatch", watch=self.wid)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
