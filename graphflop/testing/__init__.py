"""Test support importable by tests and tools: the op database (:mod:`.opdb`)."""
