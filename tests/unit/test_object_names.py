"""The object-name rule, written as one pattern and a length (``protocol.check_object_name``),
accepts and refuses exactly what its plain statement does: 1-255 characters of letters, digits and '._:/-', starting with a
letter or digit, no empty path part (a trailing '/' aside) and no '.' or '..' part."""

import itertools
import random
import re

import pytest

from ipcpool import protocol
from ipcpool.errors import InvalidRequest

_CHARS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,254}")


def _by_the_statement(name: str) -> bool:
    return bool(_CHARS.fullmatch(name)) and "//" not in name and "/../" not in f"/{name}/" \
        and "/./" not in f"/{name}/"


TRICKY = [".", "..", "a/./b", "a/../b", "a//b", "a/", "a/.", "a/..", "a/./", "a/../", "a/...", "a/.b", "a/..b",
          "a.", "a..", ".a", "-a", "_a", ":a", "/a", "a" * 255, "a" * 256, "a/" * 127 + "a", "a/" * 128, "ä", "aä",
          "a b", "a\n", "\na", "a\nb", "", "a\\b", "A-Z_0.9:x/y-z", "weights/layer1/", "ｱ", "\u212a"]


def _accepted(name: str) -> bool:
    try:
        protocol.check_object_name("name", name)
    except InvalidRequest:
        return False
    return True


@pytest.mark.parametrize("name", TRICKY)
def test_the_check_judges_each_tricky_name_as_the_statement_does(name):
    assert _accepted(name) == _by_the_statement(name)


def test_the_check_agrees_on_every_short_name_and_on_random_ones():
    names = ["".join(t) for n in range(7) for t in itertools.product("a./", repeat=n)]
    rnd = random.Random(7)
    names += ["".join(rnd.choice("a.:/-_Z9 \nä") for _ in range(rnd.randint(0, 14))) for _ in range(20000)]
    names += [(base * 300)[:n] for base in ("a", "a/", "a/.", "a.") for n in (254, 255, 256)]
    assert [n for n in names if _accepted(n) != _by_the_statement(n)] == []


@pytest.mark.parametrize("name", ["a/../b", "a" * 256, "a\n", ".a", "a//b"])
def test_a_refused_name_is_told_with_the_rule(name):
    with pytest.raises(InvalidRequest, match=r"invalid object name .*1-255 characters .*'\.' or '\.\.' path parts"):
        protocol.check_object_name("name", name)


def test_a_counters_next_name_is_judged_as_the_statement_does():
    # After a valid name, its head with any last part takes the short way (a head seen and a part
    # of ASCII digits): digits of other scripts, empty parts, dots and lengths must still be told.
    heads = ["step", "a/b", "w.1/x:2", "a/" * 120 + "a", "t-0"]
    tails = ["0", "41", "9" * 20, "", "٣", "²", "4.2", "..", ".", "1/", "1/..", "x", "1\n", "1" * 260]
    for head in heads:
        assert _accepted(f"{head}/seen")
        for tail in tails:
            name = f"{head}/{tail}"
            assert _accepted(name) == _by_the_statement(name), name
    assert protocol.valid_object_name("step/123") and "step" in protocol._VALID_HEADS


def test_the_c_check_a_steady_writer_uses_judges_every_name_as_the_statement_does():
    """``_native.valid_name`` (a steady writer's create checks its name in that one call): the same
    tricky, short and random names as the pattern, and anything not a str refused."""
    native = pytest.importorskip("ipcpool.shm._native", reason="ipcpool's C part is not built here")
    names = TRICKY + ["".join(t) for n in range(7) for t in itertools.product("a./", repeat=n)]
    rnd = random.Random(11)
    names += ["".join(rnd.choice("a.:/-_Z9 \nä\ud800") for _ in range(rnd.randint(0, 14))) for _ in range(20000)]
    names += [(base * 300)[:n] for base in ("a", "a/", "a/.", "a.") for n in (254, 255, 256)]
    assert [n for n in names if native.valid_name(n) != _by_the_statement(n)] == []
    assert [native.valid_name(x) for x in (b"step/1", None, 7, ["a"])] == [False] * 4
