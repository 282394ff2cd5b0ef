"""Hostile run directories: attacks on every reader of a checkpoint, and a fuzzer.

Someone who can write a run directory can make stalwart load their tensors; they
must never make it run code, read outside the run, crash, hang or exhaust
memory. Each case runs in ``worker.py``, a subprocess under a memory and a time
limit, so a hang or a huge allocation shows up as a failed case, not a stuck suite.
"""
