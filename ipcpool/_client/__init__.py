"""The client's parts, one job each; ``ipcpool/__init__.py`` re-exports what is public.

Imports run one way, from the facade down:

    client     Client and connect(): the public facade, delegating to the parts below
    leases     Buffer, and the lease table: import, release, create, seal, get, batch attach
    catalog    listing names page by page, and Subscription (seals announced under a prefix)
    growables  GrowableBuffer, Remap, and the table of the growable buffers this client has attached
    handoff    the hand-off without waiting: arenas and carving, credits, seal boards, pending leases
    interop    torch tensors, CuPy and numpy arrays over leases (the memory protocol only)
    rangetensors  the tensor over each slab range, kept for the range's next object
    pools      the pools this client imported, each with its seal board
    channel    the two sockets, request ids, and who takes what arrives (replies, notices)
    settings   what a client reads from the environment when it connects
    gcpause    the cyclic collector held off while a batch attach builds its objects
"""
