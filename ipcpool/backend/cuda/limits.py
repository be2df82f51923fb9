"""Sizes the CUDA backend works with, and the measurements behind them."""

# The largest single pool allocation an importer may be handed. Importing a larger one kills the
# importer (SIGSEGV inside the pointer import, after the pool import succeeded; DESIGN.md).
# Measured 2026-11-22 on an NVIDIA H200, driver 580.159.04 (CUDA 13.0), cuda.core 1.2.0,
# cuda-bindings 13.3.1, with a probe (one child process per size, a fresh
# 8 GiB-max pool each): every size up to 5.125 GiB (5502926848 B) imported and was written end to
# end; 5.140625 GiB (5519704064 B) and above segfaulted (5.25, 5.5, 6 GiB too). The boundary is not
# 4 GiB there, but it is undocumented and may move with the driver, device or pool layout: keep a
# wide margin below the first failure. An allocation placed after a 3 GiB one failed at the same
# point (5.125 ok, 5.25 GiB not). docs/design.md, "Limits measured on the driver" (the probe and
# its results are in git history).
IMPORT_LIMIT = 1 << 32
# Larger allocations and named objects are VMM chunks of at most this size (well under the limit).
VMM_CHUNK = 2 << 30
SLAB_SIZE = 1 << 30
SLAB_ALIGN = 512
