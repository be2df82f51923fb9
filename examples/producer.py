"""Allocate broker memory, write into it, and print a token a consumer can open.

    python examples/producer.py            # then run examples/consumer.py TOKEN
"""

import sys
import time

import ipcpool

with ipcpool.connect() as client:
    with client.allocate(1 << 20) as buf:
        buf.view[:] = b"ipcpool!" * (buf.size // 8)
        print(buf.share().hex(), flush=True)
        # The memory lives while we (or anyone who opened it) hold it.
        time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 30)
