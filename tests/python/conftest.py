import os
import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed(request):
    """A fresh seed per test (printed on failure); DFSS_TEST_SEED replays one."""
    seed = int(os.environ.get("DFSS_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None:
        for name, value in item.user_properties:
            if name == "seed":
                print(f"\n[dfss] {item.nodeid}: DFSS_TEST_SEED={value}")
