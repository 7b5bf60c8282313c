"""services/buffer/fifo.py: the bounded FIFO of rollout fragments."""

from __future__ import annotations

from services.buffer.fifo import RolloutFifo


def filled(capacity: int, *items: tuple[str, int]) -> RolloutFifo[str]:
    fifo: RolloutFifo[str] = RolloutFifo(capacity)
    for item, steps in items:
        assert fifo.put(item, steps) == []
    return fifo


def test_put_and_take_in_order():
    fifo = filled(100, ("a", 3), ("b", 2), ("c", 4))
    assert (len(fifo), fifo.steps) == (3, 9)
    assert fifo.take(5) == ["a", "b"]
    assert (len(fifo), fifo.steps) == (1, 4)
    assert fifo.take(4) == ["c"]
    assert (len(fifo), fifo.steps) == (0, 0)


def test_take_returns_none_and_pops_nothing_when_too_few_steps():
    fifo = filled(100, ("a", 3), ("b", 2))
    assert fifo.take(6) is None
    assert (len(fifo), fifo.steps) == (2, 5)
    assert fifo.take(5) == ["a", "b"]


def test_take_from_empty_fifo_returns_none():
    fifo: RolloutFifo[str] = RolloutFifo(10)
    assert fifo.take(1) is None
    assert fifo.take(0) is None


def test_take_pops_whole_items_until_min_steps_reached():
    fifo = filled(100, ("a", 3), ("b", 3), ("c", 3))
    assert fifo.take(4) == ["a", "b"]  # 6 steps: items are never split
    assert fifo.steps == 3
    assert fifo.take(1) == ["c"]


def test_eviction_of_oldest_when_over_capacity():
    fifo = filled(10, ("a", 4), ("b", 4))
    assert fifo.put("c", 4) == ["a"]
    assert (len(fifo), fifo.steps) == (2, 8)
    assert fifo.put("d", 9) == ["b", "c"]
    assert (len(fifo), fifo.steps) == (1, 9)
    assert fifo.take(9) == ["d"]


def test_filling_exactly_to_capacity_evicts_nothing():
    fifo = filled(8, ("a", 4))
    assert fifo.put("b", 4) == []
    assert fifo.steps == 8


def test_single_item_larger_than_capacity_is_kept():
    fifo: RolloutFifo[str] = RolloutFifo(5)
    assert fifo.put("huge", 8) == []
    assert (len(fifo), fifo.steps) == (1, 8)
    assert fifo.put("small", 1) == ["huge"]
    assert (len(fifo), fifo.steps) == (1, 1)


def test_large_item_evicts_everything_before_it():
    fifo = filled(5, ("a", 2), ("b", 2))
    assert fifo.put("huge", 7) == ["a", "b"]
    assert fifo.take(7) == ["huge"]
