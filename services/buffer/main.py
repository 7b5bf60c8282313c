"""Buffer wiring: config -> a Store per policy's table (restored from a checkpoint) -> gRPC server -> the
checkpoint and stats loops (loops.py) -> shutdown (with a last checkpoint), on the common lifecycle
(services/common/service/lifecycle.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from kuberl.v1 import buffer_pb2
from services.buffer.checkpoint import BufferCheckpointer
from services.buffer.loops import checkpoint_loop, merge_stats_loop
from services.buffer.owner import StoreOwner, use_thread
from services.buffer.servicer import BufferServicer, add_to_server
from services.buffer.tables import TableRouter
from services.buffer.store import Store
from services.config import ExperimentConfig, load_role_config
from services.common.net.grpcutil import MiB
from services.common.service.lifecycle import Lifecycle
from services.common.service.runtime import base_parser, run_service, write_ready_file
from services.common.stats import Metrics, tick_forever

log = logging.getLogger(__name__)
SHUTDOWN_DEADLINE_S = 10.0


@dataclass
class Table:
    """One policy's table: a whole buffer of its own (services/buffer/tables.py)."""
    name: str
    store: Store
    owner: StoreOwner
    servicer: BufferServicer
    checkpointer: BufferCheckpointer | None
    threaded: bool
    why: str


async def open_table(cfg: ExperimentConfig, name: str, metrics: Metrics, checkpoint_dir: str | None) -> Table:
    """A table's store (restored from its checkpoint, before it serves: pushes go into the restored ring)."""
    store = Store(cfg, metrics)
    threaded, why = use_thread(cfg.buffer.store_thread, replay=store.replay is not None)
    owner = StoreOwner(threaded)
    metrics.set("buffer/store_thread", float(threaded))
    checkpointer = None
    if checkpoint_dir and store.replay is None:
        log.warning("buffer checkpoints are on (%s) but this buffer holds PPO's FIFO, which is not checkpointed "
                    "(its on-policy fragments go stale within a few updates): a restarted buffer starts empty",
                    checkpoint_dir)
    elif checkpoint_dir:
        checkpointer = BufferCheckpointer(store, cfg, checkpoint_dir, metrics, owner)
        await checkpointer.restore()
    return Table(name, store, owner, BufferServicer(store, metrics, owner), checkpointer, threaded, why)


@asynccontextmanager
async def serving(cfg: ExperimentConfig, *, listen: str, metrics_listen: str | None = None,
                  checkpoint_dir: str | None = None):
    """Start a buffer; yields its Endpoints. Leaving the context runs the shutdown sequence.
    `checkpoint_dir` (default: `buffer.checkpoint_dir`; None: off): where a DQN buffer checkpoints its
    replay and restores it from before it serves (services/buffer/checkpoint.py); with several policies,
    each table in a directory of its own there, named after its policy.
    One table per policy of the run (services/buffer/tables.py); one policy: the buffer's own metrics."""
    metrics = Metrics("buffer")
    checkpoint_dir = checkpoint_dir or cfg.buffer.checkpoint_dir
    names = cfg.policy_names
    tables = [await open_table(cfg.for_policy(name), name, metrics if len(names) == 1 else Metrics("buffer", instance_id=name),
                               checkpoint_dir if not checkpoint_dir or len(names) == 1
                               else str(Path(checkpoint_dir) / name))
              for name in names]
    router = TableRouter({t.name: t.servicer for t in tables}, metrics)
    lc = Lifecycle("buffer", metrics, deadline_s=SHUTDOWN_DEADLINE_S)
    await lc.serve(listen, lambda s: add_to_server(router, s), [buffer_pb2.DESCRIPTOR.services_by_name["Buffer"].full_name],
                   max_message_bytes=cfg.buffer.max_message_mb * MiB, metrics_listen=metrics_listen, tls=cfg.tls,
                   auth=cfg.auth)
    for t in tables:
        log.info("buffer %sfor %s (%s), %s; the store works %s (%s)",
                 f"table {t.name!r} " if len(tables) > 1 else "", cfg.algorithm, cfg.env.id,
                 f"replay of {t.store.replay.capacity}" if t.store.replay is not None
                 else f"FIFO of {t.store.fifo.capacity_steps} steps",
                 "on a thread of its own" if t.threaded else "on the event loop", t.why)
    async with lc.running():
        if len(tables) > 1:   # (the buffer's own metrics tick with the lifecycle; each table's here)
            for t in tables:
                lc.task(tick_forever(t.servicer.metrics), f"stats-{t.name}")
            lc.task(merge_stats_loop(router.refresh), "stats-merge")
        lc.on_stop(router.close)               # refuse new pushes, ack open ones, end batch streams
        lc.on_stop(lc.stop_server(grace=2.0))  # let in-flight calls finish
        # A last checkpoint of each table's final contents, after the deadline: a large ring takes longer
        # to write, and a write cut short leaves the previous one.
        checkpoint_stop = asyncio.Event()
        savings = [lc.task(checkpoint_loop(t.checkpointer, checkpoint_stop), f"checkpoint-{t.name}", keep=True)
                   for t in tables if t.checkpointer is not None]
        lc.after_deadline(checkpoint_stop.set)
        for saving in savings:
            lc.after_deadline(lambda saving=saving: saving)

        def stopped() -> None:  # acknowledged and never served: kept by the last checkpoint, else gone
            for t in tables:
                log.info("buffer %sstopped: %d fragments received (%d samples), %d samples served, %d held (%s)",
                         f"table {t.name!r} " if len(tables) > 1 else "",
                         t.servicer.metrics.counters["buffer/fragments_received_total"], t.store.inserted_samples,
                         t.store.served_samples, t.store.size,
                         "in its last checkpoint" if t.checkpointer is not None else "lost with it: no checkpoint")
        lc.after_deadline(stopped)
        for t in tables:
            lc.after_deadline(t.owner.close)   # after the last checkpoint: it runs its instant on the owner
        await lc.ready()
        yield lc.endpoints


def parse_args(argv=None) -> argparse.Namespace:
    p = base_parser("buffer", 50051, "Holds experience and streams training batches to learners.")
    p.add_argument("--checkpoint-dir", default=os.environ.get("KUBERL_BUFFER_CHECKPOINT_DIR") or None,
                   help="DQN: checkpoint the replay here and restore it at start (default "
                        "$KUBERL_BUFFER_CHECKPOINT_DIR, else the config's buffer.checkpoint_dir; unset: off)")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    cfg = load_role_config(args)
    async with serving(cfg, listen=args.listen, metrics_listen=args.metrics_listen or None,
                       checkpoint_dir=args.checkpoint_dir) as endpoints:
        write_ready_file(args.ready_file, endpoints)
        log.info("buffer serving gRPC on %s, metrics on %s", endpoints.grpc, endpoints.metrics)
        await stop.wait()


def main(argv=None) -> int:
    return run_service("buffer", parse_args(argv), serve)
