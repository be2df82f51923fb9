"""A client arena's seal-board words (``ClientArena.slot``): pure bookkeeping, no broker."""

from types import SimpleNamespace

from ipcpool._client.handoff import ClientArena
from ipcpool.shm import sealboard


def test_a_word_freed_is_used_again_last_and_numbers_only_grow():
    """A reader that looks late at a word finds its object's number there as long as no later
    object took the word: a word freed goes behind every other free one."""
    arena = ClientArena(1, None, SimpleNamespace(size=1 << 20), words=0, first_seq=41)
    word, seq = arena.slot()
    assert seq == 41                                   # numbered from where the broker said
    arena.slots.append(word)                           # (given back as a seal gives it)
    later = [arena.slot() for _ in range(sealboard.BLOCK - 1)]
    assert word not in [w for w, _ in later]
    assert [s for _, s in later] == list(range(42, 42 + sealboard.BLOCK - 1))
    assert arena.slot() == (word, 42 + sealboard.BLOCK - 1)   # the freed word, once all others are taken
    assert arena.slot() is None


def test_an_arena_without_a_block_has_no_words():
    assert ClientArena(1, None, SimpleNamespace(size=1 << 20), words=None).slot() is None
