"""The broker fuzzer: ``fuzz_broker`` drives it (``python tests/fuzz/fuzz_broker.py --help`` for the
long run), ``frames`` makes the frames it sends, ``verdict`` judges the broker's replies. The suite
runs a small seeded run of it (tests/integration/test_fuzz.py)."""
