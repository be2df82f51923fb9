"""The hand-off benchmark's lines take turns in rounds (``bench.turns``): how a run is cut into
rounds, and where a consumer waits for its turn. Real queues, one process and a thread."""

import multiprocessing as mp
import threading

import pytest

from bench.turns import Turn, bounds


def test_rounds_split_the_hand_offs_as_evenly_as_can_be():
    assert bounds(1050, 10) == [0, 105, 210, 315, 420, 525, 630, 735, 840, 945, 1050]
    assert bounds(11, 3) == [0, 3, 7, 11]
    assert bounds(5, 1) == [0, 5]


@pytest.mark.parametrize("n, rounds", [(5, 0), (3, 4)])
def test_more_rounds_than_hand_offs_or_none_at_all_are_refused(n, rounds):
    with pytest.raises(ValueError, match=f"{n} hand-offs cannot be taken in {rounds} rounds"):
        bounds(n, rounds)


def test_a_consumer_waits_at_its_gate_where_each_round_starts_and_says_once_that_it_is_ready():
    ctx = mp.get_context("spawn")
    go, ready, gate = ctx.SimpleQueue(), ctx.SimpleQueue(), ctx.SimpleQueue()
    consumer = Turn(go, ready, gate, (0, 3))
    sent = []

    def run():
        for i in range(5):
            consumer.put(i)
            sent.append(i)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(0.3)
    assert sent == [] and ready.get() is True and ready.empty()   # ready, then held at round 0's gate
    gate.put(True)
    t.join(0.3)
    assert sent == [0, 1, 2] and t.is_alive()                      # held again where round 1 starts
    gate.put(True)
    t.join(5)
    assert sent == [0, 1, 2, 3, 4] and not t.is_alive()
    assert [go.get() for _ in range(5)] == [0, 1, 2, 3, 4]         # each put passed on, in order
    producer = Turn(go, ready)
    go.put("next")
    assert producer.get() == "next" and ready.get() is True and ready.empty()
