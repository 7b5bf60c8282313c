"""A buffer of several tables (services/buffer/tables.py): what its GetStats says for the whole buffer."""

from __future__ import annotations

from services.buffer.tables import merged_metrics
from services.common.stats import Metrics


def test_the_whole_buffer_sums_counters_and_rates_and_keeps_each_tables_own():
    red, blue = Metrics("buffer"), Metrics("buffer")
    red.inc("buffer/fragments_received_total", 3)
    blue.inc("buffer/fragments_received_total", 4)
    red.set("buffer/actors_live", 2)
    blue.set("buffer/actors_live", 2)   # (the same two actors watch both tables)
    red.set("buffer/samples_per_insert", 8.0)
    blue.set("buffer/samples_per_insert", 2.0)
    red.set("buffer/size_samples", 100)
    blue.set("buffer/size_samples", 50)
    red.set("buffer/samples_produced", 10)
    blue.set("buffer/samples_produced", 30)
    out = merged_metrics({"red": red.snapshot(), "blue": blue.snapshot()})
    assert out["buffer/fragments_received_total"] == 7
    assert out["buffer/policies/red/fragments_received_total"] == 3
    assert out["buffer/policies/blue/fragments_received_total"] == 4
    assert out["buffer/actors_live"] == 2
    # What they hold and produced adds up; the replay ratio is over all they produced (8 x 10 + 2 x 30) / 40.
    assert out["buffer/size_samples"] == 150 and out["buffer/samples_produced"] == 40
    assert out["buffer/samples_per_insert"] == 3.5
    assert (out["buffer/policies/red/samples_per_insert"], out["buffer/policies/blue/samples_per_insert"]) == (8.0, 2.0)
    # The process's own figures are the buffer's, once, not a table's.
    assert not any(k.endswith(("uptime_s", "cpu_seconds_total")) for k in out)
