"""Buffer wiring: config -> Store (restored from a checkpoint) -> gRPC server -> the checkpoint loop ->
shutdown (with a last checkpoint), on the common lifecycle (services/common/service/lifecycle.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from contextlib import asynccontextmanager

from kuberl.v1 import buffer_pb2
from services.buffer.checkpoint import BufferCheckpointer
from services.buffer.owner import StoreOwner, use_thread
from services.buffer.servicer import BufferServicer, add_to_server
from services.buffer.store import Store
from services.config import ExperimentConfig, load_role_config
from services.common.net.grpcutil import MiB
from services.common.service.lifecycle import Lifecycle
from services.common.service.runtime import base_parser, run_service, write_ready_file
from services.common.stats import Metrics

log = logging.getLogger(__name__)
SHUTDOWN_DEADLINE_S = 10.0


@asynccontextmanager
async def serving(cfg: ExperimentConfig, *, listen: str, metrics_listen: str | None = None,
                  checkpoint_dir: str | None = None):
    """Start a buffer; yields its Endpoints. Leaving the context runs the shutdown sequence.
    `checkpoint_dir` (default: `buffer.checkpoint_dir`; None: off): where a DQN buffer checkpoints its
    replay and restores it from before it serves (services/buffer/checkpoint.py)."""
    metrics = Metrics("buffer")
    store = Store(cfg, metrics)
    threaded, why = use_thread(cfg.buffer.store_thread, replay=store.replay is not None)
    owner = StoreOwner(threaded)
    metrics.set("buffer/store_thread", float(threaded))
    checkpointer = None
    checkpoint_dir = checkpoint_dir or cfg.buffer.checkpoint_dir
    if checkpoint_dir and store.replay is None:
        log.warning("buffer checkpoints are on (%s) but this buffer holds PPO's FIFO, which is not checkpointed "
                    "(its on-policy fragments go stale within a few updates): a restarted buffer starts empty",
                    checkpoint_dir)
    elif checkpoint_dir:
        checkpointer = BufferCheckpointer(store, cfg, checkpoint_dir, metrics, owner)
        await checkpointer.restore()  # before serving: pushes go into the restored ring
    servicer = BufferServicer(store, metrics, owner)
    lc = Lifecycle("buffer", metrics, deadline_s=SHUTDOWN_DEADLINE_S)
    await lc.serve(listen, lambda s: add_to_server(servicer, s), [buffer_pb2.DESCRIPTOR.services_by_name["Buffer"].full_name],
                   max_message_bytes=cfg.buffer.max_message_mb * MiB, metrics_listen=metrics_listen, tls=cfg.tls,
                   auth=cfg.auth)
    log.info("buffer for %s (%s), %s; the store works %s (%s)", cfg.algorithm, cfg.env.id,
             f"replay of {store.replay.capacity}" if store.replay is not None
             else f"FIFO of {store.fifo.capacity_steps} steps",
             "on a thread of its own" if threaded else "on the event loop", why)
    async with lc.running():
        lc.on_stop(servicer.close)             # refuse new pushes, ack open ones, end batch streams
        lc.on_stop(lc.stop_server(grace=2.0))  # let in-flight calls finish
        if checkpointer is not None:
            # A last checkpoint of the final contents, after the deadline: a large ring takes longer to
            # write, and a write cut short leaves the previous one.
            checkpoint_stop = asyncio.Event()
            saving = lc.task(checkpointer.run(checkpoint_stop), "checkpoint", keep=True)
            lc.after_deadline(checkpoint_stop.set)
            lc.after_deadline(lambda: saving)

        def stopped() -> None:  # acknowledged and never served: kept by the last checkpoint, else gone
            log.info("buffer stopped: %d fragments received (%d samples), %d samples served, %d held (%s)",
                     metrics.counters["buffer/fragments_received_total"], store.inserted_samples,
                     store.served_samples, store.size,
                     "in its last checkpoint" if checkpointer is not None else "lost with it: no checkpoint")
        lc.after_deadline(stopped)
        lc.after_deadline(owner.close)   # after the last checkpoint: it runs its instant on the owner
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
