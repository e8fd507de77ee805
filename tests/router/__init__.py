"""Tests of ``kvpool route``: the block index, event feeds, the front door, and live replicas."""
