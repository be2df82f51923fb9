"""The parts of ``bench/fuzz_broker.py``: the frames it sends (``frames``) and how it judges the
broker's replies (``verdict``)."""
