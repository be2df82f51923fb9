"""Open memory a producer shared, zero-copy, and check it.

    python examples/consumer.py TOKEN
"""

import sys

import numpy as np

import ipcpool

with ipcpool.connect() as client:
    with client.open(bytes.fromhex(sys.argv[1])) as buf:
        arr = np.asarray(buf)                       # no copy: the array is the broker's memory
        print(f"{buf.size} bytes, starts with {bytes(arr[:8])!r}")
