"""The parity recipe (``lora_qwen``), its arms, its artifacts and the data-parallel mesh.

Users import ``LoraQwen``, ``load_arm_record`` and friends from ``pytest_sprite`` (the one public surface).
Importing this package imports no torch; the model and the Lightning fit load when an arm runs. It never
imports ``pytest_sprite.assertions``: both sides meet in ``pytest_sprite.records`` and ``pytest_sprite.planted_faults``.
"""
