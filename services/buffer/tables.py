"""A buffer of several tables: one per policy of a run that trains several (config `policies`,
docs/multi-agent.md "Several policies"), as Reverb holds a table per kind of data.

Each table is a whole buffer of its own (a Store, its owner, its rate limiter, its checkpoint; a
BufferServicer over them), with its own counters. `TableRouter` is the gRPC servicer: a call's
`kuberl-policy` metadata (services/common/net/policy.py) names its table; a call without it goes to the
only table, and a buffer of several refuses it, naming them. SetTopology goes to every table (the
shards are shared: a shard drains when every table is drained). GetStats without a policy answers for
the whole buffer (`merged_metrics`, each table read on its store's owner): counters, rates and sizes
summed over the tables, the replay ratio over all, the live actors (each watches every table) once,
and each table's figures under `buffer/policies/<policy>/...`; naming a policy, that table's own."""

from __future__ import annotations

from typing import Any

import grpc

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.buffer.servicer import BufferServicer
from services.common.net.policy import METADATA_KEY, requested
from services.common.net.shards import combined_samples_per_insert
from services.common.stats import Metrics

PROCESS_WIDE = ("buffer/uptime_s", "buffer/cpu_seconds_total")   # (a table's snapshot has them too: once)


def summed(name: str) -> bool:
    """Whether a table metric adds up over tables (counters and rates) rather than being its own."""
    return name.endswith(("_total", "_per_s")) and name not in PROCESS_WIDE


SUMMED_GAUGES = ("buffer/size_samples", "buffer/samples_produced")   # (what the tables hold and made)


def merged_metrics(snapshots: dict[str, dict[str, float]]) -> dict[str, float]:
    """The tables' snapshots as the whole buffer's: counters, rates, what they hold and produced summed;
    the replay ratio held over all of them (`combined_samples_per_insert`); the live actors once; and
    each table's figures under buffer/policies/<name>/."""
    out: dict[str, float] = {}
    for name, snapshot in snapshots.items():
        for key, value in snapshot.items():
            if key in PROCESS_WIDE:
                continue
            out[f"buffer/policies/{name}/{key.removeprefix('buffer/')}"] = value
            if summed(key) or key in SUMMED_GAUGES:
                out[key] = out.get(key, 0.0) + value
            elif key == "buffer/actors_live":   # (an actor watches each table it pushes to: counted once)
                out[key] = max(out.get(key, 0.0), value)
    if (ratio := combined_samples_per_insert(snapshots.values())) is not None:
        out["buffer/samples_per_insert"] = ratio
    return out


def _routed(rpc: str) -> Any:
    """A TableRouter method that hands the call to the table its metadata names."""
    async def method(self: TableRouter, request: Any, context: Any) -> Any:
        table = await self._table(context, rpc)
        return await getattr(table, rpc)(request, context)
    method.__name__ = rpc
    return method


class TableRouter(buffer_pb2_grpc.BufferServicer):
    """Routes each call to the BufferServicer of the table its metadata names."""

    def __init__(self, tables: dict[str, BufferServicer], metrics: Metrics):
        self.tables, self.metrics = tables, metrics
        self._merged: dict[str, float] = {}   # the tables' figures as of the last `refresh`
        if len(tables) > 1:
            metrics.add_gauges(lambda: self._merged)

    async def refresh(self) -> None:
        """Read every table's figures, each on its store's owner (between its calls), and merge them
        (every second: services/buffer/loops.py, `merge_stats_loop`)."""
        self._merged = merged_metrics({name: await t.run(t.metrics.snapshot, urgent=True)
                                       for name, t in self.tables.items()})

    async def _table(self, context, rpc: str) -> BufferServicer:
        name = requested(context)
        if name is None and len(self.tables) == 1:
            return next(iter(self.tables.values()))
        table = self.tables.get(name) if name is not None else None
        if table is None:
            names = ", ".join(self.tables)
            problem = (f"names no policy, and this buffer holds a table for each of {names}: name one"
                       if name is None else f"{name!r} is not a policy of this run (its tables: {names})")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"kuberl.v1.Buffer/{rpc}: metadata {METADATA_KEY}: {problem}")
        assert table is not None
        return table

    def close(self) -> None:
        for table in self.tables.values():
            table.close()

    # The calls about one table go to it as they are (a streaming one writes its stream to `context`).
    PushTrajectories = _routed("PushTrajectories")
    StreamBatches = _routed("StreamBatches")
    ReportProgress = _routed("ReportProgress")
    WatchInsertLimit = _routed("WatchInsertLimit")

    async def SetTopology(self, request: buffer_pb2.SetTopologyRequest, context) -> buffer_pb2.TopologyAck:
        """Every table takes the list; the shard is drained when every table is, and holds what all hold."""
        acks = [await table.SetTopology(request, context) for table in self.tables.values()]
        ack = acks[0]
        ack.drained = all(a.drained for a in acks)
        ack.size_samples = sum(a.size_samples for a in acks)
        ack.actors_live = max(a.actors_live for a in acks)   # (an actor watches each table it pushes to)
        return ack

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        if len(self.tables) == 1 or requested(context) is not None:
            table = await self._table(context, "GetStats")
            return await table.GetStats(request, context)
        await self.refresh()
        return self.metrics.response()
