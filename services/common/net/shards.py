"""Buffer shards: one experiment's experience held by N buffer processes (`topology.buffers`).

The roles name their buffers with one address list, `host:port[,host:port...]`, in shard order (the
`--buffer` flag, $KUBERL_BUFFER). An actor pushes to one shard only, `shard_of` its id, so each
shard's dedupe windows, high-water marks and compact-replay chains see every fragment of the actors it
holds; a learner streams batches from every shard and reports to each what it consumed from it, so
each shard's rate limiter holds its own replay ratio (or FIFO) and the sum holds in total
(docs/architecture.md, "Buffer shards").
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping

MAX_SHARDS = 64


def buffer_addresses(spec: str) -> list[str]:
    """The shard addresses in `spec` ("host:port,host:port"), in order; ValueError naming what is wrong."""
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise ValueError(f"buffer addresses {spec!r}: must be host:port, or several separated by commas "
                         "(one per buffer shard, in shard order)")
    for p in parts:
        host, sep, port = p.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"buffer address {p!r} (in {spec!r}): must be host:port with a port in 1..65535")
    if len(set(parts)) != len(parts):
        raise ValueError(f"buffer addresses {spec!r}: an address is listed twice (each shard is one buffer)")
    if len(parts) > MAX_SHARDS:
        raise ValueError(f"buffer addresses {spec!r}: {len(parts)} shards, at most {MAX_SHARDS}")
    return parts


def shard_of(actor_id: str, shards: int, actor_index: int | None = None) -> int:
    """The shard an actor with an index pushes to (`--actor-index`: a local run's actor-i): the index
    modulo `shards`, which spreads consecutive actors evenly. Without an index (a Deployment's pods,
    named at random) a stable hash of its id: the fallback of `least_loaded`, which an actor without
    an index uses when it starts."""
    if shards <= 1:
        return 0
    if actor_index is not None:
        return actor_index % shards
    return zlib.crc32(actor_id.encode()) % shards


def least_loaded(live: Mapping[int, float], shards: int, actor_id: str) -> int:
    """The shard an actor without an index pushes to: of the shards that answered with their count of
    live actors (`live`: shard -> `buffer/actors_live`), one with the fewest, ties going to the first
    at or after `shard_of(actor_id)` (so actors that start together and see the same counts still
    spread by their hash); `shard_of` when no shard answered."""
    home = shard_of(actor_id, shards)
    if not live:
        return home
    return min(live, key=lambda i: (live[i], (i - home) % shards))


def combined_samples_per_insert(stats: Iterable[Mapping[str, float]]) -> float | None:
    """The replay ratio held over every shard, from each shard's GetStats: samples served over samples
    produced, summed (each shard's `buffer/samples_per_insert` weighted by its `buffer/samples_produced`);
    None when no shard reports a ratio."""
    served = produced = 0.0
    seen = False
    for s in stats:
        if "buffer/samples_per_insert" not in s:
            continue
        seen = True
        made = s.get("buffer/samples_produced", 0.0)
        served += s["buffer/samples_per_insert"] * made
        produced += made
    if not seen:
        return None
    return served / produced if produced > 0 else 0.0
