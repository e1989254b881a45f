import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray 2.60 default: keep token auth on in tests
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the CPU step channel stays on loopback


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    import block_invariant

    block_invariant.track_engines()


@pytest.fixture(scope="module", autouse=True)
def _engines_released_after_their_module():
    """Engines a module built give their models and caches back when it ends: an LLM freezes what is alive when it is
    built out of the cyclic collector's view (gc.freeze, so a full collection never stalls a step), so its reference
    cycles outlive it, and a few demo-pair engines in fp32 would otherwise fill a 24 GiB machine."""
    import gc

    import block_invariant

    before = set(map(id, block_invariant.ENGINES))
    yield
    for llm in [e for e in block_invariant.ENGINES if id(e) not in before]:
        block_invariant.ENGINES.discard(llm)
        vars(llm).clear()
    gc.collect()


@pytest.fixture(autouse=True)
def _blocks_free_when_idle():
    """After every test, an idle engine has all its KV blocks free (in process and behind a live server)."""
    import block_invariant

    yield
    leaks = block_invariant.engine_leaks() + block_invariant.server_leaks()
    assert not leaks, "KV blocks not returned: " + "; ".join(leaks)


@pytest.fixture(autouse=True)
def _pinned_step_costs(monkeypatch):
    """Engines built in tests get fixed step costs instead of timing their models on a busy machine (the probe itself
    is tested in test_spec_policy.py); servers get them through --step-costs (tests/service.py)."""
    from engine_pairs import cheap_draft_costs

    from dspark_serve.engine import llm

    monkeypatch.setattr(llm, "probe_costs", lambda *a, **k: cheap_draft_costs())


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Every test starts from the same global RNG state: unseeded random inputs are the same on every run."""
    torch.manual_seed(0)


@pytest.fixture
def kernel_config():
    """kernel_config(pdl=False, ...) installs the current KernelConfig with those fields for one test; the config
    before it is back after the test."""
    from dataclasses import replace

    from dspark_serve.kernels import config

    before = config.active()
    yield lambda **fields: config.install(replace(config.active(), **fields))
    config.install(before)
