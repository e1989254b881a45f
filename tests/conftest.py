import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray 2.60 default: keep token auth on in tests
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the CPU step channel stays on loopback


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Every test starts from the same global RNG state: unseeded random inputs are the same on every run."""
    torch.manual_seed(0)
