"""The spec decode counters: absent until an engine drafts, then the scheduler's counts added
as they grow, across epochs (each epoch's scheduler counts from zero); the dropped drafts of an
async run, scraped from the real /metrics endpoint, are the ones the worker dropped."""
from __future__ import annotations

from prometheus_client import generate_latest

from engine_common.runtime.metrics_http import start_metrics_server

from scheduler_service.core.spec_decode import SpecStats
from scheduler_service.engine.engine_core import StepStats
from scheduler_service.core.kv_cache_manager import PrefixCacheStats
from scheduler_service.engine.metrics import SchedulerMetrics
from tests.support.metrics_scrape import scrape
from tests.support.spec_sim import periodic_sample
from tests.unit.scheduler_service.core.test_spec_decode import _requests
from tests.unit.scheduler_service.core.test_spec_decode_async import _run

M = {"model_name": "m"}


def _value(metrics: SchedulerMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value("deltaserve:" + name, {**M, **labels}) or 0.0


def test_counters_follow_the_schedulers_counts_across_epochs():
    metrics = SchedulerMetrics("m")
    step, prefix = StepStats(), PrefixCacheStats()
    metrics.observe_step(step, prefix)
    assert b"spec_decode" not in generate_latest(metrics.registry)
    metrics.observe_step(step, prefix, SpecStats(2, 6, 4, [2, 1, 1]))
    assert _value(metrics, "spec_decode_num_dropped_drafts_total") == 0
    metrics.observe_step(step, prefix, SpecStats(3, 9, 5, [3, 1, 1], num_dropped=2))
    assert _value(metrics, "spec_decode_num_drafts_total") == 3
    assert _value(metrics, "spec_decode_num_draft_tokens_total") == 9
    assert _value(metrics, "spec_decode_num_accepted_tokens_total") == 5
    assert _value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="0") == 3
    assert _value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1
    metrics.observe_epoch()                       # a new scheduler: its counts restart
    assert _value(metrics, "spec_decode_num_dropped_drafts_total") == 2
    metrics.observe_step(step, prefix, SpecStats(1, 3, 3, [1, 1, 1], num_dropped=1))
    assert _value(metrics, "spec_decode_num_drafts_total") == 4
    assert _value(metrics, "spec_decode_num_dropped_drafts_total") == 3
    assert _value(metrics, "spec_decode_num_accepted_tokens_total") == 8
    assert _value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position="2") == 2


def test_dropped_drafts_of_an_async_run_on_the_metrics_endpoint():
    """Async scheduling with noise (test_spec_decode_async): drafts over the step in flight
    whose guess failed are dropped by the worker; fed after every step as the engine feeds
    them, the endpoint's counter is the worker's count, and the verified ones are vLLM's."""
    metrics = SchedulerMetrics("m")
    server = start_metrics_server("127.0.0.1:0", metrics.registry)
    try:
        def on_step(sched):
            metrics.observe_step(StepStats(), PrefixCacheStats(), sched.spec.stats)
        _, sched, worker = _run(_requests(), periodic_sample(3, 5), spec=True,
                                asynchronous=True, on_step=on_step)
        got = scrape(server.port)
    finally:
        server.stop()
    assert worker.dropped > 0 and sched.spec.stats.num_dropped == worker.dropped
    assert got.get("deltaserve:spec_decode_num_dropped_drafts_total", **M) == worker.dropped
    assert got.get("deltaserve:spec_decode_num_drafts_total", **M) == len(worker.verified)
