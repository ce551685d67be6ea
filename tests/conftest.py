import os
import sys

import pytest
import torch

# Tests import helpers as top-level modules (``_dist``, ``_tiny_models``) and each other's fixtures across the
# package folders; worker processes inherit sys.path.
sys.path.insert(0, os.path.dirname(__file__))
from _paths import test_dirs

sys.path[:0] = [d for d in test_dirs() if d not in sys.path]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP spin-waits on a busy machine (restored afterwards).

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def single_process_group():
    """The test may form a one-rank process group in this process: it is destroyed and RANK etc. restored after."""
    from _dist import restored_process_group

    with restored_process_group():
        yield


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """shardcal's cache ($SHARDCAL_CACHE: evaluation baselines, the demo's import) in the session's temporary
    directory, never the user's ~/.cache."""
    saved = os.environ.get("SHARDCAL_CACHE")
    os.environ["SHARDCAL_CACHE"] = str(tmp_path_factory.mktemp("shardcal-cache"))
    yield
    if saved is None:
        os.environ.pop("SHARDCAL_CACHE", None)
    else:
        os.environ["SHARDCAL_CACHE"] = saved
