"""Benchmarks: every timing the project reports, outside pytest (see README, docs/)."""
