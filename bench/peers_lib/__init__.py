"""Pieces of bench/peers.py: the workload, the systems under test, and the report."""
