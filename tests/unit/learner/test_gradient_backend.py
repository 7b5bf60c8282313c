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


@pytest.mark.parametrize("devices,nccl,want,why", [
    (["cpu", "cpu"], True, "gloo", "not every learner trains on CUDA"),
    (["cpu"], False, "gloo", "not every learner trains on CUDA"),
    (["cuda:GPU-a", "cuda:GPU-b"], True, "nccl", "2 GPUs"), (["cuda:GPU-a"], True, "nccl", "1 GPUs"),
    (["cuda:GPU-a", "cpu"], True, "gloo", "not every learner trains on CUDA"),  # everything through the CPU
    (["cuda:GPU-a", "cuda:GPU-b"], False, "gloo", "this torch has no NCCL"),    # gradients through the CPU
    # Two learners on one GPU (a one-GPU machine with `learners: 2`): NCCL refuses duplicate GPUs.
    (["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-a"], True, "gloo", "ranks 0 and 2 share the GPU GPU-a"),
])
def test_the_backend_follows_the_devices(monkeypatch, devices, nccl, want, why):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    backend, reason = gradient_backend(devices)
    assert backend == want and reason.startswith(why)


def test_a_device_is_named_the_same_in_every_process():
    assert distributed.device_id(torch.device("cpu")) == "cpu"
    if torch.cuda.is_available():   # (on a GPU machine: its UUID, whatever index CUDA_VISIBLE_DEVICES gives it)
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        assert distributed.device_id(torch.device("cuda:0")) == f"cuda:{uuid}"


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

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    # Each member on a GPU of its own: the UUID as the member's process would read it.
    monkeypatch.setattr(distributed, "device_id", lambda device: f"cuda:GPU-{device.index}")
    monkeypatch.setattr(Rendezvous, "_connect_nccl", fake_nccl)
    members = [Rendezvous(address, rank, timeout_s=30, device=torch.device(f"cuda:{rank}")) for rank in range(2)]
    with ThreadPoolExecutor(2) as pool:
        syncs = list(pool.map(lambda r: r.form(2), members))
    assert [s.backend for s in syncs] == ["nccl", "nccl"] and sorted(built) == [(0, 1, 2), (1, 1, 2)]
    with ThreadPoolExecutor(2) as pool:   # the rounds still meet over gloo
        assert list(pool.map(lambda s: s.agree(False, True), syncs)) == [(False, True)] * 2
    for s in syncs:
        s.close()
    assert Rendezvous(f"127.0.0.1:{free_port()}", 0).device == torch.device("cpu")   # unless told otherwise


def test_two_learners_on_one_gpu_form_their_group_over_gloo(monkeypatch):
    """NCCL refuses two ranks on one GPU; before the members compared their devices, such a group
    broke at its first all-reduce and was re-formed, and broke again, for ever."""
    address = f"127.0.0.1:{free_port()}"
    built = []
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(distributed, "device_id", lambda device: "cuda:GPU-only")
    monkeypatch.setattr(Rendezvous, "_connect_nccl", lambda self, store, g, n: built.append(self.rank))
    members = [Rendezvous(address, rank, timeout_s=30, device=torch.device("cuda:0")) for rank in range(2)]
    with ThreadPoolExecutor(2) as pool:
        syncs = list(pool.map(lambda r: r.form(2), members))
    assert [s.backend for s in syncs] == ["gloo", "gloo"] and built == []
    with ThreadPoolExecutor(2) as pool:
        sums = list(pool.map(lambda s: s.sum(torch.tensor([float(s.rank + 1)])), syncs))
    assert [t.item() for t in sums] == [3.0, 3.0]
    for s in syncs:
        s.close()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh runs it on one)")


@cuda
def test_on_a_real_gpu_two_learners_share_it_over_gloo_and_one_alone_uses_nccl():
    """What the fakes above stand in for, on a machine with a GPU: the real device ids, the real NCCL."""
    gpu = torch.device("cuda:0")
    address = f"127.0.0.1:{free_port()}"
    members = [Rendezvous(address, rank, timeout_s=60, device=gpu) for rank in range(2)]
    with ThreadPoolExecutor(2) as pool:
        syncs = list(pool.map(lambda r: r.form(2), members))
        assert [s.backend for s in syncs] == ["gloo", "gloo"]
        grads = list(pool.map(lambda s: _averaged(s, gpu), syncs))
    assert all(torch.allclose(g, torch.full((3,), 1.5, device=gpu)) for g in grads)
    for s in syncs:
        s.close()
    alone = Rendezvous(f"127.0.0.1:{free_port()}", 0, timeout_s=60, device=gpu).form(1)
    assert alone.backend == "nccl"          # a real ProcessGroupNCCL, on the GPU
    assert torch.allclose(_averaged(alone, gpu), torch.full((3,), 1.0, device=gpu))
    alone.close()


def _averaged(sync: GradientSync, device: torch.device) -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(3, device=device))
    p.grad = torch.full((3,), float(sync.rank + 1), device=device)
    sync.average_gradients([p], weight=1.0)
    return p.grad
