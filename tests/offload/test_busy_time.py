"""Busy time and the honest throughput metrics: overlapping transfers count their time once."""

from kvtier.engine.metrics import MetricsRegistry
from kvtier.offload.busy_time import BusyTime
from kvtier.offload.metrics import OffloadMetrics


def test_overlapping_intervals_count_once_in_any_report_order():
    busy = BusyTime()
    assert busy.add(2.0, 3.0) == 1.0
    assert busy.add(0.0, 10.0) == 9.0  # reported later, started earlier: only the new part
    assert busy.add(9.0, 12.0) == 2.0
    assert busy.add(20.0, 21.0) == 1.0
    assert busy.add(11.0, 20.5) == 8.0  # bridges the gap [12, 20]
    assert busy.add(5.0, 6.0) == 0.0
    assert busy.seconds == 21.0


def test_empty_interval_adds_nothing():
    busy = BusyTime()
    assert busy.add(4.0, 4.0) == 0.0
    assert busy.seconds == 0.0


def test_throughput_of_concurrent_jobs_is_bytes_over_wall_clock():
    registry = MetricsRegistry()
    metrics = OffloadMetrics(registry)
    # Two 100-byte jobs on two threads, each 2 s, overlapping for 1 s: 3 s of wall clock.
    metrics.transfer("fs_to_host", 100, 2.0, ended=12.0)
    metrics.transfer("fs_to_host", 100, 2.0, ended=13.0)
    assert 'kvtier:offload_bytes_total{direction="fs_to_host"}' not in registry.snapshot()
    metrics.flush()  # the tiering manager's poll, once a step
    snapshot = registry.snapshot()
    assert snapshot['kvtier:offload_busy_seconds_total{direction="fs_to_host"}'] == 3.0
    assert snapshot['kvtier:offload_transfer_seconds_sum{direction="fs_to_host"}'] == 4.0
    assert snapshot['kvtier:offload_throughput_bytes_per_second{direction="fs_to_host"}'] == (
        200 / 3.0)
    assert metrics.snapshot()['kvtier:offload_busy_seconds_total{direction="fs_to_host"}'] == 3.0


def test_transfers_of_one_flush_reported_out_of_order_count_their_union_once():
    metrics = OffloadMetrics()
    for start, end in [(0.0, 2.0), (5.0, 6.0), (1.0, 3.0), (5.5, 5.75)]:
        metrics.transfer("disk_to_host", 10, end - start, ended=end)
    assert metrics.snapshot()['kvtier:offload_busy_seconds_total{direction="disk_to_host"}'] == 4.0
    metrics.transfer("disk_to_host", 10, 3.0, ended=5.5)  # 2.5-5.5: only 3-5 is new
    assert metrics.snapshot()['kvtier:offload_busy_seconds_total{direction="disk_to_host"}'] == 6.0
