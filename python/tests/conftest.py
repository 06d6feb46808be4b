import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cluster as cluster_mod  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One coordinator and two shards for the whole session (jobs differ by
    name)."""
    c = cluster_mod.Cluster(shards=2, work_dir=str(tmp_path_factory.mktemp("cluster")))
    yield c
    c.stop()
