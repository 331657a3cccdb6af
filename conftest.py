"""Repository-level test configuration: pytester for testing the plugin from the outside."""

import pytest

pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "resume_matrix: the full checkpoint-resume matrix (strategies x precisions x sizes, reshard 4->2, "
        "12 faults; many minutes on 2 cores); deselect with -m 'not resume_matrix'",
    )
