"""Assertions on distributed training: FP32 parity against one device, and proof that planted faults are caught.

Every assertion raises an ``AssertionError`` with a table a person can read and returns a structured result.
Users import them from ``pytest_sprite`` (the one public surface); this package imports no torch and never
imports ``pytest_sprite.recipes``: both sides meet in ``pytest_sprite.records`` and ``pytest_sprite.planted_faults``.
"""
