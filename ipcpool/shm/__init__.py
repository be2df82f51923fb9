"""Every shared-memory layout of ipcpool, one module each: who makes it, who writes, who reads, and
how a reader checks it. Each is a memfd whose FD the broker sends on the control socket.

    sealboard   per pool: 64-bit words, a block of 256 per arena. The broker makes it and sends it
                with the pool's FD; a writer posts its object's sequence number after recording
                the seal, and a reader answered *pending* spins on that word. Every client of the
                pool may write it (as it may write the pool's memory): a reader checks the index
                against the board's bounds, and the broker still tells of every seal.
    directory   per pool: where each live named object lies, its state, seal word and event.
                Written only by the broker (a seqlock per entry), sealed read-only
                (``sealing``) before it goes out, mapped read-only by the pool's clients.
    leases      per session: the hazard slots a reader writes before it reads an object it found
                in a directory, read by the broker (after ``fence``) before it frees or reuses
                that memory. Sealed against shrinking; garbage there pins only its own objects.
    requests    per session, in its lease page's memfd after the slots: a ring of the hand-off's
                frames (create, seal) the client puts there instead of its control socket while
                the broker busy-polls (the directory header says until when), read by the broker
                each turn. Garbage there ends only its own session.
    growboard   per broker: a word per growable buffer, stamped by the broker at every grow
                before anyone is answered or told. Written only by the broker, sealed read-only;
                a client uses it only when it carries those seals.

And what they rest on:

    sealing     memfds only the broker can write (F_SEAL_FUTURE_WRITE), checked by who maps them
    fence       the asymmetric memory barrier (membarrier) that makes a slot written by a reader
                and an entry changed by the broker meet: readers pay nothing, the broker a syscall
    native      which hot calls on these layouts run in C (``_native.c``, where built): the
                directory's lookup, state check and publish, the ring's put, the board's post
                after a seal's record; each module falls back to its Python

These modules import only ``errors``, ``ranges`` and each other: never the backend, the protocol,
the broker or the client (``tests/unit/test_layers.py`` checks it).
"""
