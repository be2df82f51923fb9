"""The trace hook (``ipcpool.trace``): events reach the one subscriber in order with their fields,
nothing happens without one, a subscriber that raises is dropped without failing what it traced,
and every emission point is guarded and documented."""

import logging
import re
from pathlib import Path

import pytest

from ipcpool import trace
from ipcpool.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_subscriber_left():
    trace.set_trace(None)
    yield
    trace.set_trace(None)


def test_events_arrive_in_order_with_their_fields():
    got = []
    with trace.tracing(lambda event, info: got.append((event, info))):
        trace.emit("client.wait", rid=3)
        trace.emit("broker.entry", pool="default", name="h/1", index=17)   # ``name`` is a field
        trace.emit("client.views", count=2, kind="numpy")
    assert got == [("client.wait", {"rid": 3}), ("broker.entry", {"pool": "default", "name": "h/1", "index": 17}),
                   ("client.views", {"count": 2, "kind": "numpy"})]


def test_without_a_subscriber_nothing_is_called():
    got = []
    with trace.tracing(got.append):
        pass
    assert trace.hook is None
    assert trace.emit("client.wait", rid=1) is None
    assert got == []


def test_tracing_restores_whoever_was_subscribed_before():
    outer, inner = [], []
    with trace.tracing(lambda event, info: outer.append(event)):
        with trace.tracing(lambda event, info: inner.append(event)):
            trace.emit("client.wait", rid=1)
        trace.emit("client.received", nbytes=9)
    assert (outer, inner) == (["client.received"], ["client.wait"])
    assert trace.set_trace(None) is None


def test_a_subscriber_that_raises_is_dropped_and_logged_and_the_emitter_goes_on(caplog):
    calls = []

    def broken(event, info):
        calls.append(event)
        raise KeyError("field the diagnostic expected")

    trace.set_trace(broken)
    with caplog.at_level(logging.ERROR, logger="ipcpool.trace"):
        trace.emit("client.wait", rid=1)   # does not raise
        trace.emit("client.wait", rid=2)
    assert calls == ["client.wait"] and trace.hook is None
    assert [r.getMessage() for r in caplog.records] == [
        f"the trace callback {broken!r} failed on 'client.wait' and is unsubscribed"]
    assert caplog.records[0].exc_info[0] is KeyError


def test_the_environment_names_the_brokers_subscriber():
    assert trace.from_environment({}) is None and trace.from_environment({"IPCPOOL_TRACE": " "}) is None
    callback = trace.from_environment({"IPCPOOL_TRACE": "tests.support.tracing:fail"})
    assert trace.hook is callback and callback.__name__ == "fail"


@pytest.mark.parametrize("spec", ["tests.support.nowhere:record", "tests.support.tracing:nothing",
                                  "tests.support.tracing", "tests.support.tracing:FILE_ENV", ":record"])
def test_a_name_that_does_not_resolve_is_a_configuration_error(spec):
    with pytest.raises(ConfigError, match="IPCPOOL_TRACE="):
        trace.from_environment({"IPCPOOL_TRACE": spec})
    assert trace.hook is None


def _emission_points():
    """(file, line number, event) of every ``trace.emit`` in the package, and the line before it."""
    for path in sorted((ROOT / "ipcpool").rglob("*.py")):
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            found = re.search(r"\btrace\.emit\(\"([\w.]+)\"", line)
            if found:
                yield path.relative_to(ROOT), n + 1, found.group(1), lines[n - 1].strip()


def test_every_emission_point_is_guarded_by_the_attribute_check():
    """The check costs one attribute load; an unguarded call builds its fields for nobody (~70 ns)."""
    points = list(_emission_points())
    assert len(points) >= 10
    unguarded = [(str(f), n) for f, n, _, before in points if before != "if trace.hook is not None:"]
    assert unguarded == []


def test_the_events_emitted_are_the_events_documented():
    documented = set(re.findall(r"^- ``([a-z]+\.[a-z_]+)``", trace.__doc__, re.M))
    documented |= set(re.findall(r"^- ``[a-z]+\.[a-z_]+``, ``([a-z]+\.[a-z_]+)``", trace.__doc__, re.M))
    emitted = {event for _, _, event, _ in _emission_points()}
    emitted |= set(re.findall(r"^\s+emit\(\"([\w.]+)\"", Path(trace.__file__).read_text(), re.M))
    assert emitted == documented


def test_the_steps_marked_are_the_steps_documented():
    marked = set()
    for path in sorted((ROOT / "ipcpool").rglob("*.py")):
        marked |= set(re.findall(r"^\s*@(?:trace\.)?phase\(\"(\w+)\"\)", path.read_text(), re.M))
    documented = trace.__doc__.split("``client.phase``", 1)[1].split("\n- ", 1)[0]
    assert marked == {word for word in re.findall(r"``(\w+)``", documented) if word.islower()}


def test_a_marked_step_is_seen_to_start_and_end_even_when_it_raises():
    @trace.phase("probe")
    def step(x):
        raise ValueError(x)

    seen = []
    with trace.tracing(lambda event, info: seen.append((event, info["phase"], info["at"], info["args"]))):
        with pytest.raises(ValueError, match="7"):
            step(7)
    assert seen == [("client.phase", "probe", "start", (7,)), ("client.phase", "probe", "end", (7,))]
    with pytest.raises(ValueError):   # nobody listening: the function alone
        step(8)
    assert len(seen) == 2
