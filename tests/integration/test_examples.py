"""The worker programs under examples/ run as their docstrings say, against a real broker."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_producer_and_the_consumer_hand_off_memory(broker):
    env = {**os.environ, "IPCPOOL_SOCKET_DIR": str(broker.socket_dir)}
    producer = subprocess.Popen([sys.executable, str(ROOT / "examples/producer.py"), "60"],
                                stdout=subprocess.PIPE, text=True, env=env)
    try:
        token = producer.stdout.readline().strip()
        assert token, "the producer printed no token"
        out = subprocess.run([sys.executable, str(ROOT / "examples/consumer.py"), token],
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "1048576 bytes, starts with b'ipcpool!'"
    finally:
        producer.terminate()
        producer.wait(30)
        producer.stdout.close()
