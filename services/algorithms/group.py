"""What an algorithm's learner needs of the group it may train in (torch): the gradient exchange as a
protocol, and the two steps every update takes around it.

The group itself (rendezvous, gloo, re-formation) is the learner service's
(services/learner/distributed.py: `GradientSync` is what these functions are given); an algorithm
sees only `GroupSync`, so it never imports the service.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class GroupSync(Protocol):
    """One learner's place in a group of learners that average gradients (None where it trains alone)."""
    rank: int
    world_size: int

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the group (a copy, on `t`'s device)."""
        ...

    def average_gradients(self, params: list[torch.nn.Parameter], weight: float) -> float:
        """Each parameter's gradient replaced by the weighted mean over the group; the total weight
        (0: nobody had data, the step is skipped on every rank alike)."""
        ...


def average_over_group(sync: GroupSync | None, params: list[torch.nn.Parameter], weight: float,
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
