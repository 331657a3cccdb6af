"""The launcher tests' shared engines: one real Slurm for the session (``tests/slurm_cluster.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from slurm_cluster import SlurmCluster, require_slurm, running_cluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munged, slurmctld and slurmd for the whole session; a test without Slurm here skips (fails under CI)."""
    require_slurm()
    yield from running_cluster(tmp_path_factory.mktemp("slurm"))
