"""Buffer shards (services/common/net/shards.py): the address list, which shard an actor pushes to, and
the replay ratio combined over shards."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.common.config import TopologyConfig
from services.common.settings import ConfigError
from services.common.net.shards import MAX_SHARDS, buffer_addresses, combined_samples_per_insert, shard_of


def test_addresses_are_read_in_shard_order():
    assert buffer_addresses("127.0.0.1:50051") == ["127.0.0.1:50051"]
    assert buffer_addresses("b-0.buf:50051, b-1.buf:50051") == ["b-0.buf:50051", "b-1.buf:50051"]
    assert buffer_addresses("[::1]:7000,host:7001") == ["[::1]:7000", "host:7001"]


@pytest.mark.parametrize("spec,says", [
    ("", "must be host:port"),
    ("a:1,,b:2", "must be host:port"),
    ("a:1,", "must be host:port"),
    ("localhost", "'localhost'"),
    ("a:1,b:port", "'b:port'"),
    ("a:0", "port in 1..65535"),
    (":50051", "':50051'"),
    ("a:1,a:1", "listed twice"),
    (",".join(f"h:{1000 + i}" for i in range(MAX_SHARDS + 1)), f"at most {MAX_SHARDS}"),
])
def test_malformed_address_lists_are_refused_naming_the_fault(spec, says):
    with pytest.raises(ValueError, match="buffer address") as err:
        buffer_addresses(spec)
    assert says in str(err.value)


def test_an_indexed_actor_goes_to_its_index_modulo_the_shards():
    assert [shard_of("actor-x", 3, i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert shard_of("anything", 1, 5) == 0 and shard_of("anything", 1) == 0


def test_an_unindexed_actor_hashes_to_a_stable_shard_and_ids_spread_over_all():
    ids = [f"kuberl-actor-7d9f8c-{random.Random(i).randbytes(3).hex()}" for i in range(400)]
    first = [shard_of(a, 4) for a in ids]
    assert first == [shard_of(a, 4) for a in ids]           # stable: a restart lands on the same shard
    counts = Counter(first)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 60, counts   # 100 each expected


def test_the_combined_ratio_is_served_over_produced_summed_over_shards():
    rng = random.Random(0)
    for _ in range(200):
        shards, served, produced = [], 0.0, 0.0
        for _ in range(rng.randint(1, 6)):
            made = rng.choice([0, rng.randint(1, 10_000)])
            out = rng.randint(0, 50_000)
            served, produced = served + (out if made else 0), produced + made
            shards.append({"buffer/samples_per_insert": out / made if made else 0.0, "buffer/samples_produced": made})
        want = served / produced if produced else 0.0
        assert combined_samples_per_insert(shards) == pytest.approx(want)
    # Unlike the mean of the shards' ratios: a shard that produced little counts for little.
    two = [{"buffer/samples_per_insert": 8.0, "buffer/samples_produced": 900},
           {"buffer/samples_per_insert": 2.0, "buffer/samples_produced": 100}]
    assert combined_samples_per_insert(two) == pytest.approx(7.4)
    assert combined_samples_per_insert([{}, {"buffer/size_samples": 3}]) is None


def test_the_topology_takes_1_to_max_shards():
    assert TopologyConfig(buffers=4).buffers == 4
    for bad in (0, MAX_SHARDS + 1):
        with pytest.raises(ConfigError, match="buffers"):
            TopologyConfig(buffers=bad)


def test_each_replay_shard_holds_its_share_of_the_capacity_and_the_warm_up():
    from services.algorithms import FifoTable, ReplayTable
    from services.buffer.store import shard_table

    table = ReplayTable(capacity=10_000, learning_starts=1_000, replay_ratio=8.0, replay_ratio_tolerance=0.1)
    assert shard_table(table, 1, 32) is table
    three = shard_table(table, 3, 32)
    assert (three.capacity, three.learning_starts, three.replay_ratio) == (3_334, 334, 8.0)
    assert shard_table(table, 64, 32).learning_starts == 32   # never below one batch: a batch must be cut
    fifo = FifoTable(capacity_steps=8192, max_policy_lag=None, stale_fragments="drop")
    assert shard_table(fifo, 4, 512) is fifo                  # each shard bounds what it holds unserved


def test_a_replay_too_small_to_split_is_refused_naming_the_shards():
    from services.config import config_from_dict

    cfg = config_from_dict({"algorithm": "dqn", "topology": {"buffers": 4},
                            "dqn": {"buffer_size": 4096, "batch_size": 32, "learning_starts": 64}})
    assert cfg.topology.buffers == 4
    with pytest.raises(ConfigError, match="topology.buffers") as err:
        config_from_dict({"algorithm": "dqn", "topology": {"buffers": 4},
                          "dqn": {"buffer_size": 100, "batch_size": 32, "learning_starts": 64}})
    assert "dqn.buffer_size 100 split over 4 buffer shards holds fewer than one batch (32)" in str(err.value)


def test_an_actor_without_an_index_takes_a_least_loaded_shard_ties_by_its_hash():
    from services.common.net.shards import least_loaded

    home = shard_of("pod-a", 4)
    assert least_loaded({}, 4, "pod-a") == home                                   # nobody answered: the hash
    assert least_loaded({0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}, 4, "pod-a") == home     # all equal: the hash
    assert least_loaded({0: 3.0, 1: 1.0, 2: 2.0, 3: 1.0}, 4, "pod-a") == min(     # the fewest; a tie goes to the
        (1, 3), key=lambda i: (i - home) % 4)                                     # first at or after the hash
    assert least_loaded({2: 5.0}, 4, "pod-a") == 2                                 # only one shard answered
    # actors with different hashes seeing the same empty shards spread by their hashes
    ids = [f"pod-{k}" for k in range(40)]
    assert {least_loaded({0: 0.0, 1: 0.0}, 2, a) for a in ids} == {0, 1}
