"""Synchronous data-parallel training across learners: gradients averaged with torch.distributed (gloo).

Every learner pulls its own batches from the buffer and computes gradients on them; before each
optimizer step the learners all-reduce their gradients, weighted by the samples each trained on, so
every learner applies the same averaged gradient and their parameters stay identical (as in PyTorch's
DistributedDataParallel). Policy versions therefore agree across learners, any learner can serve
weights to actors, and only rank 0 writes checkpoints.

Collectives must be matched call for call on every rank. The learners therefore move in rounds: each
round starts with `agree`, an all-reduce of (stop wanted, no batch in hand); a round trains only when
every learner holds a batch, and all stop at the same round boundary when any wants to stop. A learner
with a batch it cannot use (malformed, or all fragments too stale) still joins the round's gradient
all-reduces with weight 0, so nobody waits forever. A peer that dies breaks the group: the others'
collectives raise `GroupBroken` and the learner exits (its supervisor, services/common/supervise.py,
stops the rest and re-forms the whole group from the newest checkpoint, under `kuberl up` with or without
the planner; membership changes restart it the same way).

A step whose gradient is not finite is skipped, and the group must skip it together or its members'
parameters part. The decision is therefore taken on the averaged gradient, which is the same on every
member (a NaN anywhere makes the sum NaN everywhere); a member whose own loss is not finite makes its
gradient NaN before the average, so its verdict reaches the others too (`average_over_group`,
`finite_gradients`).
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class GroupBroken(RuntimeError):
    """A collective failed: a peer learner died or could not be reached."""


@dataclass(frozen=True)
class GroupSpec:
    rank: int
    world_size: int
    address: str          # host:port of rank 0's rendezvous store
    timeout_s: float = 120.0

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world size: {self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: {self.rank} must lie in 0..{self.world_size - 1} (world size {self.world_size})")
        if self.world_size > 1 and not self.address:
            raise ValueError("a group of more than one learner needs the rendezvous address (host:port of rank 0)")


class GradientSync:
    """One learner's membership of the group. Blocking; the trainer calls it from its worker thread."""

    def __init__(self, spec: GroupSpec):
        self.spec = spec
        self.rank, self.world_size = spec.rank, spec.world_size
        log.info("joining a group of %d learners as rank %d (rendezvous %s)", spec.world_size, spec.rank, spec.address)
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{spec.address}", rank=spec.rank,
                                    world_size=spec.world_size, timeout=timedelta(seconds=spec.timeout_s))
        except Exception as err:  # noqa: BLE001 - torch raises several kinds; all mean the same here
            raise GroupBroken(f"could not form the group of {spec.world_size} learners at {spec.address}: {err}") from err
        log.info("group of %d learners formed", spec.world_size)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(t)
        except Exception as err:  # noqa: BLE001
            raise GroupBroken(f"all-reduce across {self.world_size} learners failed (a peer is gone?): {err}") from err
        return t

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the group (a copy; gloo reduces CPU tensors, on whatever device `t` is)."""
        return self._all_reduce(t.detach().cpu().clone()).to(t.device)

    def agree(self, stop: bool, ready: bool) -> tuple[bool, bool]:
        """One round's agreement: (someone wants to stop, everyone holds a batch)."""
        t = self._all_reduce(torch.tensor([float(stop), float(not ready)]))
        return bool(t[0] > 0), bool(t[1] == 0)

    def average_gradients(self, params: list[torch.nn.Parameter], weight: float) -> float:
        """Replace each parameter's gradient with the weighted mean over the group (weight: the samples
        this learner's gradient is the mean over; 0 contributes nothing). Returns the total weight; where
        it is 0 nobody had data and the step must be skipped (on every rank alike)."""
        # One flat CPU buffer (gloo reduces CPU tensors), whatever device the learner trains on.
        grads = [p.grad.detach().reshape(-1).cpu() if p.grad is not None else torch.zeros(p.numel()) for p in params]
        flat = torch.cat([*grads, torch.ones(1)]) * weight
        self._all_reduce(flat)
        total = float(flat[-1])
        if total > 0:
            for p, avg in zip(params, torch.split(flat[:-1] / total, [p.numel() for p in params])):
                p.grad = avg.view_as(p).to(p.device)
        return total

    def broadcast_state(self, state: dict | None) -> dict:
        """Rank 0's training state (weights, optimizer, version) to every rank, so the group starts equal.

        It travels as a checkpoint does: `torch.save` bytes (tensors and plain containers only),
        read back with `weights_only=True`, so nothing received can run code when loaded (unlike
        `broadcast_object_list`, which unpickles whatever arrives)."""
        try:
            if self.rank == 0:
                buf = io.BytesIO()
                torch.save(state, buf)
                payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
                size = torch.tensor([payload.numel()], dtype=torch.int64)
            else:
                size = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(size, src=0)
            if self.rank != 0:
                payload = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.broadcast(payload, src=0)
        except Exception as err:  # noqa: BLE001
            raise GroupBroken(f"broadcasting rank 0's state failed: {err}") from err
        if self.rank == 0:
            return state
        return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=True)

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as err:  # noqa: BLE001 - leaving a broken group must not mask why it broke
                log.debug("leaving the group: %s", err)


def average_over_group(sync: GradientSync | None, params: list[torch.nn.Parameter], weight: float,
                       loss: torch.Tensor | None = None) -> float:
    """The weight behind the gradients about to be applied: this learner's own when it trains alone,
    else the group's total after `sync.average_gradients` (0: nobody had data, skip the step).

    `loss`: what this learner's gradients are of (None: it had no data). Where it is not finite, the
    gradients are set to NaN first, so that `finite_gradients` refuses the step on every learner alike
    (a non-finite loss can come with finite gradients, e.g. the Huber loss's, which are clipped)."""
    if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
        for p in params:
            if p.grad is not None:
                p.grad.fill_(math.nan)
    return weight if sync is None else sync.average_gradients(params, weight)


def finite_gradients(params: list[torch.nn.Parameter]) -> bool:
    """Whether every gradient of `params` is finite: the step may be taken. Called after
    `average_over_group`, it sees the group's averaged gradient, the same on every learner, so the
    whole group takes or skips the step together."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    return not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
