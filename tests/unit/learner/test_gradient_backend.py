"""GPU learners average their gradients over NCCL, CPU learners over gloo (services/learner/distributed.py):
the choice, and that a group built for NCCL sends the gradients, and only they, over its NCCL group.
Tested without a GPU: NCCL itself stands in as a recording process group (what stays unmeasured: a
real NCCL all-reduce between two GPUs)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from services.common.local.procs import free_port
from services.learner import distributed
from services.learner.distributed import GradientSync, GroupSpec, Rendezvous, gradient_backend


@pytest.mark.parametrize("device,nccl,want", [
    ("cpu", True, "gloo"), ("cpu", False, "gloo"),
    ("cuda", True, "nccl"), ("cuda:1", True, "nccl"),
    ("cuda", False, "gloo"),     # a torch without NCCL: gradients go through the CPU over gloo
])
def test_the_backend_follows_the_device(monkeypatch, device, nccl, want):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    assert gradient_backend(torch.device(device)) == want


class Recording:
    """A process group that sums nothing (one member) and records what went over it."""

    def __init__(self):
        self.reduced: list[torch.Tensor] = []
        self.closed = False

    def allreduce(self, tensors):
        self.reduced.extend(tensors)
        return self

    def wait(self):
        return True

    def shutdown(self):
        self.closed = True


def test_gradients_go_over_the_nccl_group_and_the_rounds_over_gloo():
    gloo, nccl = Recording(), Recording()
    sync = GradientSync(GroupSpec(0, 2, "x:1"), gloo, 1, grads=nccl, device=torch.device("cpu"))
    assert sync.backend == "nccl"
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    params[0].grad, params[1].grad = torch.full((3,), 2.0), None
    assert sync.average_gradients(params, weight=4.0) == 4.0
    (flat,) = nccl.reduced
    assert flat.device == sync.device and flat.numel() == 3 + 4 + 1          # the gradients and the weight
    assert torch.equal(params[0].grad, torch.full((3,), 2.0)) and torch.equal(params[1].grad, torch.zeros(2, 2))
    assert sync.agree(stop=False, ready=True) == (False, True)
    assert len(gloo.reduced) == 1 and len(nccl.reduced) == 1                 # the round's agreement: gloo
    sync.close()
    assert gloo.closed and nccl.closed
    cpu = GradientSync(GroupSpec(0, 2, "x:1"), gloo := Recording(), 1)
    assert cpu.backend == "gloo"
    cpu.average_gradients(params, weight=1.0)
    assert len(gloo.reduced) == 1                                            # no NCCL: everything on gloo


def test_a_group_of_cuda_learners_builds_nccl_in_its_generations_namespace(monkeypatch):
    address = f"127.0.0.1:{free_port()}"
    built = []

    def fake_nccl(self, store, g, n):
        built.append((self.rank, g, n))
        return Recording()

    monkeypatch.setattr(distributed, "gradient_backend", lambda device: "nccl" if device.type == "cuda" else "gloo")
    monkeypatch.setattr(Rendezvous, "_connect_nccl", fake_nccl)
    members = [Rendezvous(address, rank, timeout_s=30, device=torch.device("cuda")) for rank in range(2)]
    with ThreadPoolExecutor(2) as pool:
        syncs = list(pool.map(lambda r: r.form(2), members))
    assert [s.backend for s in syncs] == ["nccl", "nccl"] and sorted(built) == [(0, 1, 2), (1, 1, 2)]
    with ThreadPoolExecutor(2) as pool:   # the rounds still meet over gloo
        assert list(pool.map(lambda s: s.agree(False, True), syncs)) == [(False, True)] * 2
    for s in syncs:
        s.close()
    assert Rendezvous(f"127.0.0.1:{free_port()}", 0).device == torch.device("cpu")   # unless told otherwise
