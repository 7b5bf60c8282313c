"""The learner group's rendezvous across generations (services/learner/distributed.py, `Rendezvous`): each
member a thread of this process, with its own gloo group, so the generations are checked without
processes. Each test names the sentence of the class's contract it checks."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from services.common.procs import free_port
from services.learner.distributed import STORE_PREFIX, FormationAbandoned, GroupBroken, Rendezvous
from tests.helpers import wait_for


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


def store_keys(address: str, *keys: str) -> list[bool]:
    host, port = address.rsplit(":", 1)
    store = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                                          timeout=timedelta(seconds=10)))
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
