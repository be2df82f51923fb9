"""Shared memory the hand-off reads instead of waiting for a reply (one module per layout).

    directory   per pool: where each live named object lies, its state and seal; written only by
                the broker, sealed against writes by anyone else, mapped read-only by clients
    leases      per session: the hazard slots a reader writes before it reads an object it found
                in a directory, read by the broker before it frees or reuses that memory
    fence       the asymmetric memory barrier (membarrier) that makes a slot written by a reader
                and an entry changed by the broker meet: readers pay nothing, the broker a syscall
    sealing     memfds only the broker can write (F_SEAL_FUTURE_WRITE), checked by who maps them

The seal board (``ipcpool.board``) and the growth board (``ipcpool.growboard``) are the other two
layouts.
"""
