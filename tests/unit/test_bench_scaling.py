"""The pure parts of bench/scaling.py: topology and address planning, the commands that build it,
CPU-saturation detection from recorded /proc/stat samples, the bottleneck verdict and the projection
arithmetic. No namespace is created here (CI runs without root guarantees)."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from bench import scaling


def test_topology_names_addresses_and_links():
    nodes = scaling.plan_topology(groups=8, actor_nodes_per_group=2, link_mbit=100)
    assert len(nodes) == 1 + 8 * (1 + 1 + 2)
    assert len({n.name for n in nodes}) == len(nodes)
    assert len({n.ip for n in nodes}) == len(nodes)
    assert len({n.veth for n in nodes}) == len(nodes)
    for n in nodes:
        assert n.name.startswith(scaling.PREFIX) and len(n.name) <= 15
        assert len(n.veth) <= 15                     # Linux interface names
        assert ipaddress.ip_address(n.ip) in ipaddress.ip_network("10.77.0.0/16")
    monitor = scaling.nodes_of(nodes, "monitor")
    assert len(monitor) == 1 and monitor[0].link_mbit is None        # its stats never compete for a link
    assert all(n.link_mbit == 100 for n in nodes if n.kind != "monitor")
    for g in range(8):
        assert len(scaling.nodes_of(nodes, "shard", g)) == 1
        assert len(scaling.nodes_of(nodes, "learner", g)) == 1
        assert len(scaling.nodes_of(nodes, "actor", g)) == 2
    assert scaling.nodes_of(nodes, "shard", 3)[0].address == "10.77.1.4:50051"
    with pytest.raises(ValueError):
        scaling.plan_topology(0, 1, 100)


def test_actor_placement_follows_the_shard_index_rule():
    placement = scaling.actor_placement(actors=12, groups=4)
    assert [g for g, _ in placement] == [i % 4 for i in range(12)]   # actor i pushes to shard i % G
    assert [s for g, s in placement if g == 1] == [0, 1, 2]          # spread over the group's actor nodes


def test_setup_commands_stay_inside_our_namespaces():
    nodes = scaling.plan_topology(2, 1, 50)
    cmds = scaling.setup_commands(nodes)
    added = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert added[0] == scaling.SWITCH and set(added[1:]) == {n.name for n in nodes}
    assert all(ns.startswith(scaling.PREFIX) for ns in added)
    for c in cmds:
        if c[:3] == ["ip", "netns", "add"]:
            continue
        assert c[1] == "-n" and c[2].startswith(scaling.PREFIX), c     # nothing in the root namespace
    veths = [c for c in cmds if "veth" in c]
    assert all(c[c.index("netns") + 1].startswith(scaling.PREFIX) for c in veths)
    tbf = [c for c in cmds if c[0] == "tc"]
    assert len(tbf) == 2 * (len(nodes) - 1)                          # both ends of every limited link
    assert all("50mbit" in c and "tbf" in c for c in tbf)
    assert scaling.tbf_burst_bytes(50) == 64 * 1024
    assert scaling.tbf_burst_bytes(1000) == 1_250_000            # 10 ms of 1 Gbit/s


def test_only_our_namespaces_are_swept():
    assert scaling.ours(["kbs-sw", "kbs-s0", "cni-1234", "kbsx", "other-kbs-a0"]) == ["kbs-sw", "kbs-s0"]


PROC_STAT = "cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1\n"


def stat(user, system, idle, iowait=0):
    return scaling.parse_proc_stat(PROC_STAT.format(user=user, system=system, idle=idle, iowait=iowait))


def test_parse_proc_stat_counts_idle_and_iowait_as_not_busy():
    assert stat(100, 50, 300, 50) == (150, 500)
    with pytest.raises(ValueError):
        scaling.parse_proc_stat("intr 1\n")


def test_cpu_saturation_from_recorded_samples():
    # 2 cores, 0.25 s at 100 Hz: 50 jiffies an interval
    saturated = [stat(0, 0, 0)] + [stat(48 * i, 0, 2 * i) for i in range(1, 9)]
    v = scaling.cpu_verdict(saturated, threshold=0.9)
    assert v["saturated"] and v["busy_median"] == pytest.approx(0.96) and v["intervals"] == 8
    half = [stat(25 * i, 0, 25 * i) for i in range(9)]
    assert not scaling.cpu_verdict(half, 0.9)["saturated"]
    # one busy burst does not make a point CPU-bound: the median decides
    bursty = [stat(0, 0, 0)]
    for i in range(8):
        b, t = bursty[-1]
        busy = 50 if i == 3 else 20
        bursty.append((b + busy, t + 50))
    v = scaling.cpu_verdict(bursty, 0.9)
    assert not v["saturated"] and v["busy_max"] == 1.0
    assert scaling.cpu_verdict([stat(1, 1, 1)], 0.9)["saturated"] is False    # no interval: no verdict
    assert scaling.busy_shares([(0, 0), (10, 0), (20, 10)]) == [1.0]          # empty intervals skipped


def test_bottleneck_verdict_names_the_resource_at_its_limit():
    assert scaling.classify(True, 0.99, 1.0, 1.0) == "link-bound"     # a full link binds, cores or not
    assert scaling.classify(True, 0.5, 0.5, 0.5) == "CPU-bound"       # nothing else at its limit
    assert scaling.classify(True, 0.5, 0.95, 0.5) == "learner-bound"
    assert scaling.classify(False, 0.95, 1.0, 1.0) == "link-bound"
    assert scaling.classify(False, 0.4, 0.97, 0.5) == "learner-bound"
    assert scaling.classify(False, 0.4, 0.3, 0.99) == "actor-bound"
    assert scaling.classify(False, 0.4, 0.3, 0.5) == "unclear"


def test_every_shard_must_be_full_for_link_bound():
    links = {"kbs-s0": {"in_util": 0.97, "in_bytes_per_s": 12e6}, "kbs-s1": {"in_util": 0.6, "in_bytes_per_s": 7e6},
             "kbs-s2": {"in_util": 0.0, "in_bytes_per_s": 0.0},             # a group not running: left out
             "kbs-a0": {"in_util": 0.1, "in_bytes_per_s": 1e6}}
    assert scaling.shard_link_util(links) == 0.6
    point = {"offered_samples_per_s": 100.0, "actors_cut_samples_per_s": 50.0, "learner_busy": 0.2,
             "cpu": {"saturated": True}, "links": links}
    assert scaling.analyze(point) == "CPU-bound"
    links["kbs-s1"]["in_util"] = 0.9
    assert scaling.analyze(point) == "link-bound"


def test_cpu_attribution():
    v = {"busy_mean": 0.8}
    assert scaling.others_cores(v, ours_cores=0.6, cpus=2) == pytest.approx(1.0)
    assert scaling.others_cores(v, ours_cores=2.0, cpus=2) == 0.0
    assert scaling.others_cores({"busy_mean": None}, 0.5, 2) is None
    assert scaling.groups_fitting(2, 0.4) == 4
    assert scaling.groups_fitting(2, 0.0) == 0


def test_equilibrium_is_learner_capacity_over_the_replay_ratio():
    assert scaling.equilibrium_samples_per_s(256, 0.25, 0.25) == pytest.approx(4096)
    assert scaling.equilibrium_samples_per_s(256, 0.25, 0.25, learners=2) == pytest.approx(8192)


def test_projection_arithmetic():
    rows = scaling.project(8, link_gbit=10, goodput_share=0.9, served_wire_per_received=0.5,
                           buffer_cpu_s_per_gb=1.0, replay_ratio=0.25, sample_bytes=1000)
    assert [r["groups"] for r in rows] == list(range(1, 9))
    caps = rows[0]["caps_bytes_per_s"]
    assert caps["link in"] == pytest.approx(10e9 / 8 * 0.9)
    assert caps["link out"] == pytest.approx(10e9 / 8 * 0.9 / 0.5)
    assert caps["buffer CPU"] == pytest.approx(1e9)
    assert rows[0]["bound"] == "buffer CPU"                        # 1 GB/s < 1.125 GB/s of link
    assert rows[7]["receive_bytes_per_s"] == pytest.approx(8e9)     # groups add
    assert rows[7]["receive_samples_per_s"] == pytest.approx(8e6)
    assert rows[7]["training_samples_per_s"] == pytest.approx(2e6)  # replay ratio x receive
    slow = scaling.project(2, link_gbit=1, goodput_share=0.9, served_wire_per_received=0.5,
                           buffer_cpu_s_per_gb=1.0, replay_ratio=0.25, sample_bytes=1000)
    assert slow[0]["bound"] == "link in" and slow[1]["receive_bytes_per_s"] == pytest.approx(2 * 1e9 / 8 * 0.9)
    batches_heavy = scaling.project(1, link_gbit=1, goodput_share=1.0, served_wire_per_received=2.0,
                                    buffer_cpu_s_per_gb=0.01, replay_ratio=1, sample_bytes=1000)
    assert batches_heavy[0]["bound"] == "link out"


def test_synthetic_fragment_is_encode_fragments_payload():
    """header(seq) + body + trailer(t) equals `encode_fragment` for any seq: the synthetic actor pushes
    what a real one would."""
    from kuberl.v1 import common_pb2 as pb
    from services.common.protocol.fragments import decode_fragment, encode_fragment

    T, N, D = 4, 2, 8
    head, body, tail, samples = scaling.fragment_parts("a-1", 77, (T, N, D))
    assert samples == T * N
    payload = head(300) + body + tail(123.5)
    msg = pb.TrajectoryFragment.FromString(payload)
    assert (msg.seq, msg.incarnation, msg.actor_id, msg.created_unix_s) == (300, 77, "a-1", 123.5)
    frag = decode_fragment(msg)
    obs = frag.obs.copy()
    assert obs.shape == (T + 1, N, D) and obs.dtype == np.uint8
    again = encode_fragment(actor_id="a-1", seq=300, policy_version=0, algorithm=pb.ALGORITHM_DQN, env_ids=range(N),
                            obs=obs, actions=np.zeros((T, N), np.int64), rewards=np.zeros((T, N), np.float32),
                            terminated=np.zeros((T, N), bool), truncated=np.zeros((T, N), bool),
                            final_obs=np.empty((0, D), np.uint8), final_index=np.empty(0, np.int64),
                            created_unix_s=123.5, incarnation=77).payload
    assert payload == again
