"""The learner group's rendezvous across generations (services/learner/distributed.py, `Rendezvous`): each
member a thread of this process, with its own gloo group, so the generations are checked without
processes. Each test names the sentence of the class's contract it checks."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from services.common.local.procs import free_port
from services.learner.distributed import STORE_PREFIX, FormationAbandoned, GroupBroken, Rendezvous
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[3]
# A member in a process of its own (argv: address, rank, size), to be killed while it forms its group.
MEMBER = """
import sys, torch
torch.set_num_threads(1)
from services.learner.distributed import Rendezvous
Rendezvous(sys.argv[1], int(sys.argv[2]), timeout_s=60).form(int(sys.argv[3]))
"""


@pytest.fixture
def address():
    return f"127.0.0.1:{free_port()}"


def form_together(members: dict[Rendezvous, int], abandon: dict[Rendezvous, threading.Event] | None = None):
    """Every member's `form(size)`, each in a thread; returns what each returned, in order (or raises the
    first error)."""
    abandon = abandon or {}
    with ThreadPoolExecutor(len(members)) as pool:
        futures = [pool.submit(r.form, n, abandon.get(r)) for r, n in members.items()]
        return [f.result(timeout=60) for f in futures]


def summed(syncs) -> list[float]:
    """Each member's all-reduce of 1: the size of the group it is really in."""
    with ThreadPoolExecutor(len(syncs)) as pool:
        return [float(x) for x in pool.map(lambda s: s.sum(torch.ones(1))[0], syncs)]


def close(syncs) -> None:
    for s in syncs:
        s.close()


def store_client(address: str) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))


def store_keys(address: str, *keys: str) -> list[bool]:
    store = dist.PrefixStore(STORE_PREFIX, store_client(address))
    return [store.check([k]) for k in keys]


def test_generations_2_3_4_3_2_with_the_same_members_each_meet_in_a_namespace_of_their_own(address):
    """Rank 0 opens generation g ... every member builds gloo in the namespace g/<g>/gloo/, where no key
    of another generation lies."""
    members = [Rendezvous(address, rank, timeout_s=30) for rank in range(4)]
    for g, n in enumerate((2, 3, 4, 3, 2), start=1):
        # The others come before rank 0 has opened the generation, while the keys the previous group
        # left (its gloo addresses) are in the store: they must not be read.
        syncs = form_together({r: n for r in [*members[1:n], members[0]]})
        assert summed(syncs) == [n] * n and [s.generation for s in syncs] == [g] * n, (g, n)
        assert [s.rank for s in syncs] == [*range(1, n), 0]
        close(syncs)


def test_a_member_never_joins_a_generation_for_another_size(address):
    """A member joins the generation `open` names only if it is for the member's own size."""
    r0, r1, r2 = (Rendezvous(address, rank, timeout_s=30) for rank in range(3))
    stop0 = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        zero = pool.submit(r0.form, 2, stop0)            # rank 0 still believes in 2 learners
        one = pool.submit(r1.form, 3)                    # rank 1 has read 3
        wait_for(lambda: store_keys(address, "open") == [True], timeout=30, what="generation 1 open")
        stop0.set()                                      # rank 0 sees the new size and gives 1 up
        with pytest.raises(FormationAbandoned, match="ranks 1..1 to join generation 1"):
            zero.result(timeout=30)
        assert store_keys(address, "g/1/rank/1", "g/1/gone", "g/1/go") == [False, True, False]
        syncs = form_together({r0: 3, r2: 3}) + [one.result(timeout=30)]
    assert summed(syncs) == [3, 3, 3] and {s.generation for s in syncs} == {2}
    close(syncs)


def test_a_member_that_joined_waits_for_rank_0s_word_then_looks_for_the_next_generation(address):
    """Rank 0 ... gives it up (writes `gone`) ...; on `gone` the members that joined look for the next;
    `abandon` does not move a member that has joined."""
    r0, r1, r2 = (Rendezvous(address, rank, timeout_s=30) for rank in range(3))
    stop0, stop1 = threading.Event(), threading.Event()
    with ThreadPoolExecutor(2) as pool:
        zero = pool.submit(r0.form, 3, stop0)
        one = pool.submit(r1.form, 3, stop1)
        wait_for(lambda: store_keys(address, "g/1/rank/1") == [True], timeout=30, what="rank 1 in generation 1")
        stop1.set()   # rank 1 asked to give up after joining: it waits for rank 0's word (the message below)
        stop0.set()   # rank 2 never came; rank 0 gives generation 1 up
        with pytest.raises(FormationAbandoned):
            zero.result(timeout=30)
        with pytest.raises(FormationAbandoned, match="rank 0 to open a generation for 3"):
            one.result(timeout=30)
    syncs = form_together({r0: 3, r1: 3, r2: 3})
    assert summed(syncs) == [3, 3, 3] and [s.generation for s in syncs] == [2, 2, 2]
    close(syncs)


def test_rank_0_waits_at_most_the_timeout_and_gives_the_generation_up(address):
    r0 = Rendezvous(address, 0, timeout_s=0.5)
    with pytest.raises(GroupBroken, match=r"waited 0 s for ranks 1..1 to join generation 1 at 127\.0\.0\.1"):
        r0.form(2)
    assert store_keys(address, "g/1/gone", "g/1/go") == [True, False]
    with pytest.raises(ValueError, match="must be host:port"):
        Rendezvous("learner-0", 0)


def test_a_member_finds_a_restarted_rank_0s_new_store(address):
    """A restarted rank 0 starts a new store, and the others connect to it afresh."""
    r1 = Rendezvous(address, 1, timeout_s=30)
    old = Rendezvous(address, 0, timeout_s=30)
    syncs = form_together({old: 2, r1: 2})
    assert summed(syncs) == [2, 2]
    close(syncs)
    del syncs, old   # rank 0's process ends, and its store with it
    new = Rendezvous(address, 0, timeout_s=30)
    syncs = form_together({r1: 2, new: 2})
    assert summed(syncs) == [2, 2] and [s.generation for s in syncs] == [1, 1], "the new store counts from 1"
    close(syncs)


def test_a_restarted_member_waits_for_the_next_generation_and_joins_it(address):
    """A generation closed (`go`) is never joined: a pod that joins late (restarted) waits while rank 0
    is still in the group it left, and joins the next one rank 0 opens."""
    r0, r1 = Rendezvous(address, 0, timeout_s=30), Rendezvous(address, 1, timeout_s=30)
    old = form_together({r0: 2, r1: 2})
    restarted = Rendezvous(address, 1, timeout_s=30)   # pod 1's new process; its old one is gone
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(restarted.form, 2)
        # Rank 0 finds its peer gone only at its next collective; until then generation 1 stands.
        close(old)
        new = [r0.form(2), joining.result(timeout=30)]
    assert summed(new) == [2, 2] and [s.generation for s in new] == [2, 2]
    close(new)


def test_a_member_that_dies_after_joining_is_given_up_after_keepalive_s_and_the_others_form_the_next(address,
                                                                                                    tmp_path):
    """Rank 0 ... gives it up (writes `gone`) ... once a member that joined has not moved its heartbeat for
    `keepalive_s`; on `gone` the members that joined look for the next generation."""
    r0 = Rendezvous(address, 0, timeout_s=60, keepalive_s=2)
    r1 = Rendezvous(address, 1, timeout_s=60)
    output = tmp_path / "member-2.log"
    with ThreadPoolExecutor(2) as pool, output.open("w") as out:
        zero, one = pool.submit(r0.form, 4), pool.submit(r1.form, 4)
        wait_for(lambda: store_keys(address, "g/1/rank/1") == [True], timeout=30, what="rank 1 in generation 1")
        member = subprocess.Popen([sys.executable, "-c", MEMBER, address, "2", "4"], cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: store_keys(address, "g/1/rank/2") == [True], timeout=60,
                     what=f"rank 2's process in generation 1 (its output: {output})")
        finally:
            member.kill()   # rank 2's learner dies, rank 3's has not come yet
            member.wait(30)
        with pytest.raises(GroupBroken, match="rank 2 joined generation 1 but has not been heard from for 2 s"):
            zero.result(timeout=60)
        assert store_keys(address, "g/1/gone", "g/1/go") == [True, False]
        # Rank 1, still in its first formation, joins the next generation with rank 2's replacement.
        syncs = form_together({Rendezvous(address, 2, timeout_s=60): 4, Rendezvous(address, 3, timeout_s=60): 4,
                               r0: 4}) + [one.result(timeout=60)]
    assert summed(syncs) == [4, 4, 4, 4] and {s.generation for s in syncs} == {2}
    close(syncs)


class Died(Exception):
    """What a member of DiesConnecting does instead of making gloo's connections."""


class DiesConnecting(Rendezvous):
    """A member whose learner dies once its generation is closed (`go`), before gloo's connections."""

    def _connect(self, store, g, n):
        raise Died(f"rank {self.rank} died before connecting generation {g}")


def test_a_member_that_dies_while_gloo_connects_breaks_the_formation_after_gloo_connect_s(address):
    """Gloo's connections must be made within `gloo_connect_s` (a member that dies after `go` breaks the
    formation for the others after that long, GroupBroken, not after the timeout)."""
    r0, r1 = (Rendezvous(address, rank, timeout_s=60, gloo_connect_s=3) for rank in range(2))
    with ThreadPoolExecutor(3) as pool:
        forming = [pool.submit(r.form, 3) for r in (r0, r1, DiesConnecting(address, 2, timeout_s=60))]
        with pytest.raises(GroupBroken, match="could not form the group of 3 learners"):
            forming[2].result(timeout=60)
        for survivor in forming[:2]:
            with pytest.raises(GroupBroken, match="could not form the group of 3 learners"):
                survivor.result(timeout=60)
    syncs = form_together({r1: 3, Rendezvous(address, 2, timeout_s=60): 3, r0: 3})
    assert summed(syncs) == [3, 3, 3] and [s.generation for s in syncs] == [2, 2, 2]
    close(syncs)


def test_a_member_tries_rank_0s_store_again_and_again_and_honours_abandon_between(address, caplog):
    """A member tries to connect in attempts of `store_attempt_s` until its deadline, and `abandon` is
    honoured between them."""
    caplog.set_level(logging.INFO, logger="services.learner.distributed")
    r1 = Rendezvous(address, 1, timeout_s=3600, store_attempt_s=0.2)   # nothing listens at `address` yet
    abandon = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(r1.form, 2, abandon)
        wait_for(lambda: "is not reachable yet" in caplog.text, timeout=30, what="rank 1 trying")
        abandon.set()
        with pytest.raises(FormationAbandoned, match="stopped trying to reach rank 0's store"):
            waiting.result(timeout=60)
        # Rank 0 comes after the member began trying: a later attempt reaches it.
        joining = pool.submit(r1.form, 2)
        wait_for(lambda: caplog.text.count("is not reachable yet") == 2, timeout=30, what="rank 1 trying again")
        syncs = [Rendezvous(address, 0, timeout_s=60).form(2), joining.result(timeout=60)]
    assert summed(syncs) == [2, 2] and [s.generation for s in syncs] == [1, 1]
    close(syncs)


def test_once_a_generation_closes_rank_0_deletes_the_keys_of_those_before_it(address):
    """Once g is closed, rank 0 deletes every key of the generations before it, gloo's included."""
    r0, r1 = (Rendezvous(address, rank, timeout_s=30) for rank in range(2))
    counts = []
    for g in (1, 3, 4, 5):
        syncs = form_together({r1: 2, r0: 2})
        assert [s.generation for s in syncs] == [g, g]
        close(syncs)
        counts.append(store_client(address).num_keys())
        assert store_keys(address, *(f"g/{h}/{key}" for h in range(1, g) for key in ("go", "gone", "rank/1")),
                          f"g/{g}/go") == [False] * 3 * (g - 1) + [True], g
        if g == 1:   # generation 2 is given up at once; its `gone` goes with generation 3's close
            abandon = threading.Event()
            abandon.set()
            with pytest.raises(FormationAbandoned):
                r0.form(2, abandon)
            assert store_keys(address, "g/2/gone") == [True]
    assert counts == [counts[0]] * 4, "the store holds as many keys after the 4th group as after the 1st"
