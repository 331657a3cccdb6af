"""Repository-level test configuration: pytester for testing the plugin from the outside."""

import pytest

pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "slow: a test too slow for CI's 10-minute suite beside a faster one that covers the same path "
        "(deselect with -m 'cpu and not slow')",
    )
