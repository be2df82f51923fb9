"""Counting the requests a client sends, by op (a test of round trips wraps its channel)."""

import collections


def count_requests(client) -> collections.Counter:
    """Count what ``client`` sends from now on: requests on the message channel by op, and
    requests on the control socket (each a round trip) by op under "control:"."""
    ch, sent = client._channel, collections.Counter()
    send, control_send = ch.send, ch.control_send

    def counted_send(op, **fields):
        sent[op] += 1
        return send(op, **fields)

    def counted_control_send(msg):   # every control request is sent here, its reply awaited
        sent[f"control:{msg['op']}"] += 1
        return control_send(msg)

    ch.send, ch.control_send = counted_send, counted_control_send
    return sent
