import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-test` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request):
    """A fresh seed per run (printed, so a failure can be replayed with MICROSCALE_SEED)."""
    s = int(os.environ.get("MICROSCALE_SEED", torch.seed() % 2**31))
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: GPTQ's column loop is many small ops, faster on one thread on
    the shared CI machine. Use with pytestmark = pytest.mark.usefixtures("one_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
