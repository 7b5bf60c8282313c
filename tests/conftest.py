"""Suite-wide fixtures: fail any test that leaks asyncio tasks; keep torch to one thread."""

from __future__ import annotations

import asyncio

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
