"""Python-side policies: pure decisions over numbers, no torch, no I/O, no clock of their own.

The Python twin of ``csrc/policy/`` (CONTRIBUTING.md, "where new code goes"): each module takes the
state it decides on as plain values and returns a decision, so it is unit-tested directly and the
callers (the KV store, continuous batching, KV storage, the Redis tier) keep only the mechanism.
"""
