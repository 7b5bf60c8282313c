"""Learner wiring: config -> Trainer -> gRPC server -> fetch/train/publish/checkpoint loops -> shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time
from contextlib import asynccontextmanager

import grpc
import torch

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc, learner_pb2, learner_pb2_grpc
from services.common.config import ExperimentConfig, load_config
from services.common.fragments import ALGORITHM_CODES
from services.common.grpcutil import Backoff, MiB, describe, make_channel, raise_if_cancelling, start_server
from services.common.notify import Notifier
from services.common.prometheus import serve_metrics
from services.common.runtime import Endpoints, base_parser, run_service, write_ready_file
from services.common.stats import Metrics, tick_forever
from services.learner.publish import WeightsHub
from services.learner.servicer import LearnerServicer
from services.learner.trainer import Trainer

log = logging.getLogger(__name__)
SHUTDOWN_DEADLINE_S = 30.0


def batch_request(cfg: ExperimentConfig, learner_id: str) -> buffer_pb2.BatchRequest:
    size = cfg.dqn.batch_size if cfg.algorithm == "dqn" else cfg.ppo.batch_steps
    return buffer_pb2.BatchRequest(learner_id=learner_id, algorithm=ALGORITHM_CODES[cfg.algorithm], batch_size=size)


async def fetch_batches(stub: buffer_pb2_grpc.BufferStub, request: buffer_pb2.BatchRequest,
                        queue: asyncio.Queue, metrics: Metrics) -> None:
    """Keep a StreamBatches stream open, re-opening it when it ends; the queue bounds prefetch."""
    backoff = Backoff()
    while True:
        try:
            async for batch in stub.StreamBatches(request):
                await queue.put(batch)
                metrics.inc("learner/batches_received_total")
                backoff.reset()
        except grpc.aio.AioRpcError as err:
            raise_if_cancelling(err)
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise RuntimeError(f"the buffer refused this learner's batch request: {err.details()}") from err
            metrics.inc("learner/batch_stream_errors_total")
            log.log(logging.INFO if err.code() == grpc.StatusCode.UNAVAILABLE else logging.WARNING,
                    "batch stream from buffer ended (%s); reconnecting", describe(err))
        await backoff.sleep()


async def train_loop(trainer: Trainer, queue: asyncio.Queue, hub: WeightsHub, every: int,
                     progressed: Notifier) -> None:
    """Train on each batch as it arrives; publish when `every` updates have passed since the last."""
    published = trainer.version
    trainer.metrics.inc("learner/starved_seconds_total", 0)
    while True:
        waited = time.perf_counter()
        batch = await queue.get()
        # Time with nothing to train on: the planner's TR_L is samples / (wall time - this).
        trainer.metrics.inc("learner/starved_seconds_total", time.perf_counter() - waited)
        await asyncio.to_thread(trainer.train, batch)
        if trainer.version - published >= every:
            hub.publish(await asyncio.to_thread(trainer.weights))
            published = trainer.version
            progressed.notify()


async def report_progress(stub: buffer_pb2_grpc.BufferStub, learner_id: str, trainer: Trainer,
                          metrics: Metrics, progressed: Notifier) -> None:
    """Tell the buffer the current version after each publication, and at least once a second."""
    while True:
        request = buffer_pb2.LearnerProgress(
            learner_id=learner_id, policy_version=trainer.version,
            samples_consumed_total=int(metrics.counters["learner/samples_consumed_total"]),
            batches_consumed_total=int(metrics.counters["learner/batches_consumed_total"]))
        try:
            ack = await stub.ReportProgress(request, timeout=5.0)
            inserted = ack.samples_inserted_total
            if inserted:
                metrics.set("learner/samples_per_insert", request.samples_consumed_total / inserted)
        except grpc.aio.AioRpcError as err:
            raise_if_cancelling(err)
            metrics.inc("learner/progress_report_errors_total")
            log.debug("progress report to buffer failed: %s", describe(err))
        await progressed.wait(timeout=1.0)


async def checkpoint_loop(trainer: Trainer, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(trainer.checkpoint)


@asynccontextmanager
async def serving(cfg: ExperimentConfig, *, listen: str, metrics_listen: str | None = None, buffer: str, checkpoint_dir: str,
                  learner_id: str | None = None):
    """Start a learner; yields its Endpoints. Leaving the context runs the shutdown sequence."""
    learner_id = learner_id or f"learner-{socket.gethostname()}-{os.getpid()}"
    torch.set_num_threads(cfg.learner.torch_threads)
    metrics = Metrics("learner", instance_id=learner_id)
    trainer = Trainer(cfg, metrics, checkpoint_dir)
    hub = WeightsHub()
    hub.publish(trainer.weights())  # actors start from the learner's initialisation (or checkpoint)
    max_bytes = cfg.buffer.max_message_mb * MiB
    srv = await start_server(listen, lambda s: learner_pb2_grpc.add_LearnerServicer_to_server(
        LearnerServicer(hub, metrics), s), [learner_pb2.DESCRIPTOR.services_by_name["Learner"].full_name],
        max_message_bytes=max_bytes)
    prom = serve_metrics(metrics, metrics_listen) if metrics_listen else None
    channel = make_channel(buffer, max_bytes, receive_window_bytes=64 * 1024)
    queue: asyncio.Queue = asyncio.Queue(maxsize=cfg.buffer.batch_prefetch)
    log.info("learner %s: %s on %s, version %d, buffer %s", learner_id, cfg.algorithm, cfg.env.id,
             trainer.version, buffer)
    try:
        async with asyncio.TaskGroup() as tg:
            fetch = tg.create_task(fetch_batches(buffer_pb2_grpc.BufferStub(channel), batch_request(cfg, learner_id),
                                                 queue, metrics), name="fetch")
            progressed = Notifier()
            stub = buffer_pb2_grpc.BufferStub(channel)
            train = tg.create_task(train_loop(trainer, queue, hub, cfg.learner.publish_interval_updates, progressed),
                                   name="train")
            side = [tg.create_task(checkpoint_loop(trainer, cfg.learner.checkpoint_interval_s), name="checkpoint"),
                    tg.create_task(report_progress(stub, learner_id, trainer, metrics, progressed), name="progress"),
                    tg.create_task(tick_forever(metrics), name="stats")]
            await srv.set_serving(True)
            try:
                yield Endpoints(srv.address, prom.address if prom else None)
            finally:
                async with asyncio.timeout(SHUTDOWN_DEADLINE_S):
                    await srv.set_serving(False)  # 1. readiness goes NOT_SERVING
                    fetch.cancel()                 # 2. stop consuming; an update in flight finishes
                    train.cancel()                 #    (the checkpoint below waits for it on the lock)
                    if queue.qsize():
                        metrics.inc("learner/batches_discarded_total", queue.qsize())
                        log.info("discarding %d prefetched batches at shutdown", queue.qsize())
                    for task in side:
                        task.cancel()
                    await asyncio.to_thread(trainer.checkpoint)  # 3. final checkpoint
                    hub.close()                    # 4. end weight streams, stop serving
                    await srv.server.stop(grace=1.0)
    finally:
        await srv.close()
        if prom is not None:
            prom.close()
        await channel.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = base_parser("learner", 50052, "Trains on batches streamed from a buffer and publishes weights.")
    p.add_argument("--buffer", default=os.environ.get("KUBERL_BUFFER", "127.0.0.1:50051"),
                   help="buffer address host:port (default $KUBERL_BUFFER or 127.0.0.1:50051)")
    p.add_argument("--checkpoint-dir", default=os.environ.get("KUBERL_CHECKPOINT_DIR", "checkpoints"),
                   help="where checkpoints are written and restored from (default ./checkpoints)")
    p.add_argument("--learner-id", default=None, help="name of this learner (default: learner-host-pid)")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    cfg = load_config(args.config)
    async with serving(cfg, listen=args.listen, metrics_listen=args.metrics_listen or None, buffer=args.buffer,
                       checkpoint_dir=args.checkpoint_dir, learner_id=args.learner_id) as endpoints:
        write_ready_file(args.ready_file, endpoints)
        log.info("learner serving gRPC on %s, metrics on %s", endpoints.grpc, endpoints.metrics)
        await stop.wait()


def main(argv=None) -> int:
    return run_service("learner", parse_args(argv), serve)
