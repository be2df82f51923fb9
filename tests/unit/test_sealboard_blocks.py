"""The broker's share-out of a pool's seal board (``shm.sealboard.Blocks``): a block serves arena
after arena, and each arena numbers its objects past every number an arena before it gave out there."""

from ipcpool.shm import sealboard


def test_a_block_used_again_numbers_on_past_every_number_it_gave_out():
    board = sealboard.Board.create("blocks-test")
    try:
        blocks = sealboard.Blocks(board)
        base, first = blocks.take()
        assert first == 1
        board.post(base + 3, 40)
        blocks.give_back(base, 40)                # its arena gave out numbers up to 40
        again, first = blocks.take()
        assert (again, first) == (base, 41) and board.read(base + 3) == 0   # cleared, numbered on
        blocks.give_back(base, 0)                 # an arena that gave out none: never back to 1
        assert blocks.take() == (base, 41)
        blocks.give_back(base, sealboard.FIRST_MAX)   # (a count that wrapped: garbage) starts again
        assert blocks.take() == (base, 1)
        other, first = blocks.take()              # another block: its own numbers
        assert other != base and first == 1
    finally:
        board.close()
