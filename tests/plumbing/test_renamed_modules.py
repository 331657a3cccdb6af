"""The 0.2.0 module names still import, warn once with the new name, and are the very same module objects."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from pytest_sprite.plumbing.renamed_modules import RENAMED

pytestmark = pytest.mark.cpu

PROBE = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import pytest_sprite.chaos.protocols as old_protocols
    from pytest_sprite.faults import registered_faults
import pytest_sprite.save_crashes.protocols as new_protocols
import pytest_sprite.planted_faults as planted
import pytest_sprite.chaos, pytest_sprite.save_crashes
assert old_protocols is new_protocols
assert registered_faults is planted.registered_faults
assert pytest_sprite.chaos is pytest_sprite.save_crashes
messages = sorted(str(w.message) for w in caught if w.category is DeprecationWarning)
print("\\n".join(messages))
"""


def test_old_names_warn_and_resolve_to_the_renamed_modules() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        "pytest_sprite.chaos is renamed pytest_sprite.save_crashes; import pytest_sprite.save_crashes instead"
        " (pytest_sprite.chaos goes in pytest-sprite 0.4.0)",
        "pytest_sprite.faults is renamed pytest_sprite.planted_faults; import pytest_sprite.planted_faults instead"
        " (pytest_sprite.faults goes in pytest-sprite 0.4.0)",
    ]


def test_every_renamed_module_has_its_alias_module() -> None:
    for old in RENAMED:
        assert importlib.util.find_spec(old) is not None, old
