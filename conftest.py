"""Repository-level test configuration: pytester for testing the plugin from the outside."""

import pytest

pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "resume_matrix: the full checkpoint-resume matrix (strategies x precisions x sizes, reshard 4->2, "
        "12 faults; many minutes on 2 cores); deselect with -m 'not resume_matrix'",
    )
    config.addinivalue_line(
        "markers",
        "chaos_matrix: full crash-consistency matrices (lora_qwen strategies at 1 and 2 ranks, HF Trainer, the "
        "shared-temp race with flake=; many minutes on 2 cores); deselect with -m 'not chaos_matrix'",
    )
