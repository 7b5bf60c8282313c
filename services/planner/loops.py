"""The planner's loop. `decision_loop` (main.py's "decide" task, unless `planner.enabled` is false)
wakes every second (every `planner.interval_s` if that is shorter): once `planner.interval_s` has passed
since the last decision it takes the next (`Planner.step`: measure every replica's rates, decide, apply
through the backend, record), and otherwise only measures, which keeps the rates' moving averages
smooth; then it publishes the buffer shard list and carries a shard's addition or drain on a step
(`ShardKeeper.sync`, services/planner/shards.py). Each of these holds the planner's lock, so none
overlaps a decision asked for over gRPC (Preview, Apply, SetReplicas). It runs until the shutdown
cancels it.

Elsewhere, not loops of the planner's decisions: the Kubernetes backend renews its leader Lease in a
task of its own (services/planner/lease.py), and each WatchDecisions stream waits for the next decision
recorded (services/planner/servicer.py).
"""

from __future__ import annotations

import asyncio

from services.planner.core import Planner


async def decision_loop(planner: Planner) -> None:
    """Decide every `planner.interval_s`; measuring in between keeps the EWMAs smooth."""
    interval = planner.cfg.planner.interval_s
    tick = min(1.0, interval)
    next_decision = planner.clock() + interval
    while True:
        await asyncio.sleep(tick)
        if planner.clock() >= next_decision:
            next_decision = planner.clock() + interval
            await planner.step("interval")
        else:
            async with planner.lock:
                await planner.observer.measure()
        async with planner.lock:
            await planner.shards.sync()   # publish the shard list, carry an add or a drain on
