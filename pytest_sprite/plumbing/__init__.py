"""Stdlib-only plumbing both sides share: frames, the clock, rank ranges, output tails, processes,
placement, collective-stack reading, and the gated private reaches into dependencies.
"""
