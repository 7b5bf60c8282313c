"""Suite-wide fixtures: fail any test that leaks asyncio tasks; keep torch to one thread. And the tiers: what
`make test` and `make test-learning` each run, and the fast tier's tests that took over 60 s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

# A real kube-apiserver (+ etcd, kube-controller-manager) for the Kubernetes tests: fixtures k8s_cluster,
# k8s_namespace, k8s_admin, k8s_controller_manager (see tests/k8s/cluster.py).
pytest_plugins = ("tests.k8s.cluster",)


@pytest.fixture(autouse=True)
async def no_leaked_tasks():
    """Fail a test that leaves asyncio tasks running behind it (kopf's discipline)."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
    for _ in range(20):  # let cancellations that are already under way settle
        if not leaked:
            break
        await asyncio.sleep(0.05)
        leaked = [t for t in leaked if not t.done()]
    assert not leaked, f"test leaked asyncio tasks: {[t.get_name() + ' ' + repr(t.get_coro()) for t in leaked]}"


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


# -- the two tiers ---------------------------------------------------------------------------------------
# `make test` runs `-m "not learning"` (every unit, integration and deploy behaviour, in at most 15 minutes
# of pytest on 2 cores); `make test-learning` runs `-m learning` (every test that trains to a return).
LEARNING_DIR = Path(__file__).parent / "learning"
FAST_TIER_LIMIT_S = 60.0


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if LEARNING_DIR in Path(item.path).parents:   # a test that trains to a return is in the learning tier
            item.add_marker(pytest.mark.learning)


_phase_seconds: dict[str, float] = {}
_exempt: set[str] = set()   # learning tests, and those marked over_60s


def pytest_runtest_logreport(report):
    """Add up each test's setup, call and teardown (the controller sees its workers' reports under xdist)."""
    _phase_seconds[report.nodeid] = _phase_seconds.get(report.nodeid, 0.0) + report.duration
    if "learning" in report.keywords or "over_60s" in report.keywords:
        _exempt.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    """Name every `make test` test that took longer than 60 s without an `over_60s(reason)` mark: the fast
    tier's budget is 15 minutes, and one slow test is where it goes first. Reported, never failed: wall
    time depends on the machine's load."""
    over = sorted(((s, n) for n, s in _phase_seconds.items()
                   if s > FAST_TIER_LIMIT_S and n not in _exempt), reverse=True)
    if over:
        terminalreporter.section(f"tests over {FAST_TIER_LIMIT_S:.0f} s without an over_60s mark")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f}s {nodeid}")
