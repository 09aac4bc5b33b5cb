"""SchedulerMetrics and ServingCounters on hand-made outputs and steps: which histogram each
output feeds, the engine's counters across epochs, and the scrape-time gauges and counters read
from the same EngineStats and ServingCounters that GetServerStatus reads."""
from __future__ import annotations

import pytest

from scheduler_service.core.kv_cache_manager import PrefixCacheStats
from scheduler_service.core.request import RequestStatus
from scheduler_service.engine.engine_core import StepStats
from scheduler_service.engine.engine_stats import EngineStats
from scheduler_service.engine.metrics import SchedulerMetrics, request_token_buckets
from scheduler_service.engine.output_processor import RequestOutput, RequestTimings
from scheduler_service.engine.serving_counters import ServingCounters
from scheduler_service.errors import EngineUnavailable, RequestFailed, WorkerFailure

M = {"model_name": "m"}


def out(rid, new, total, finish=None, prompt=5, cached=0, scheduled=0.5, error=None):
    return RequestOutput(rid, list(range(new)), "x" * new, [], finish is not None, finish, None,
                         prompt, total, cached, RequestTimings(0.0, None, None, scheduled),
                         error)


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value("deltaserve:" + name, {**M, **labels})


@pytest.fixture()
def metrics():
    return SchedulerMetrics("m", max_model_len=128)


def test_each_output_feeds_its_histograms(metrics):
    metrics.observe_outputs([out("a", 2, 2), out("b", 1, 1, scheduled=None)], 0.001)
    metrics.observe_outputs([out("a", 1, 3)], 0.002)
    metrics.observe_outputs([out("a", 1, 4, RequestStatus.FINISHED_LENGTH),
                             out("b", 0, 1, RequestStatus.FINISHED_ABORTED, scheduled=None),
                             out("c", 0, 0, RequestStatus.FINISHED_ABORTED,
                                 error=RequestFailed("boom"))], 0.003)
    assert value(metrics, "time_to_first_token_seconds_count") == 2      # a and b
    assert value(metrics, "inter_token_latency_seconds_count") == 2      # a's later outputs
    assert value(metrics, "e2e_request_latency_seconds_count") == 2      # c failed: not here
    assert value(metrics, "request_generation_tokens_sum") == 4 + 1
    assert value(metrics, "request_prompt_tokens_count") == 2
    assert value(metrics, "request_queue_time_seconds_count") == 1       # b never scheduled
    assert value(metrics, "request_decode_time_seconds_count") == 1
    assert value(metrics, "step_duration_seconds_count", phase="output_processing") == 3
    assert metrics._token_times == {}


def test_step_phases_and_engine_counters_across_epochs(metrics):
    first = PrefixCacheStats(queries=10, hits=4)
    metrics.observe_step(StepStats(0.001, 0.01, 0.002, 300, 3, 40, 1), first)
    metrics.observe_step(StepStats(0.001, 0.0, 0.0, 200, 2, 2, 0), first)  # async: only submits
    first.queries, first.hits = 15, 6
    metrics.observe_step(StepStats(0.0, 0.01, 0.001, 0, 0, 0, 2), first)  # only collects
    metrics.observe_epoch()                               # a new core, its counts from zero
    metrics.observe_step(StepStats(), PrefixCacheStats(queries=3, hits=1))
    assert value(metrics, "step_duration_seconds_count", phase="schedule") == 2
    assert value(metrics, "step_duration_seconds_count", phase="round_trip") == 2
    assert value(metrics, "step_diff_bytes_sum") == 500
    assert value(metrics, "step_batch_size_sum") == 5
    assert value(metrics, "iteration_tokens_total_sum") == 42
    assert value(metrics, "num_preemptions_total") == 3
    assert value(metrics, "prefix_cache_queries_total") == 18
    assert value(metrics, "prefix_cache_hits_total") == 7
    assert value(metrics, "epochs_started_total") == 1


def test_worker_failures_by_kind(metrics):
    metrics.observe_failure(WorkerFailure("late", kind="step_timeout"))
    metrics.observe_failure(WorkerFailure("gone"))
    metrics.observe_failure(EngineUnavailable("not ready"))
    metrics.observe_failure(ValueError("a bug"))
    metrics.observe_epoch()
    assert value(metrics, "step_failures_total", kind="step_timeout") == 1
    assert value(metrics, "step_failures_total", kind="unavailable") == 2
    assert value(metrics, "step_failures_total", kind="internal") == 1
    assert value(metrics, "epochs_started_total") == 1


def test_scrape_reads_the_snapshots_get_server_status_reads(metrics):
    counters = ServingCounters()
    stats = [EngineStats(ready=True, num_waiting=2, num_running=3, num_used_blocks=5,
                         num_total_blocks=20, num_steps_in_flight=1, num_loras_loaded=2,
                         num_lora_loads=7, num_lora_evictions=5)]
    metrics.attach(lambda: stats[0], counters, num_workers=2)
    counters.received()
    counters.received()
    counters.rejected("INVALID_ARGUMENT")
    counters.record([out("a", 2, 2, prompt=7, cached=4),
                     out("b", 1, 3, RequestStatus.FINISHED_STOP_STRING),
                     out("c", 1, 1, RequestStatus.FINISHED_STOP_TOKEN, prompt=3),
                     out("d", 0, 0, RequestStatus.FINISHED_ABORTED, error=RequestFailed("x"))])
    counters.failed_after_output()
    assert value(metrics, "num_requests_waiting") == 2
    assert value(metrics, "num_requests_running") == 3
    assert value(metrics, "kv_cache_usage_perc") == 0.25
    assert value(metrics, "kv_blocks_used") == 5 and value(metrics, "kv_blocks_total") == 20
    assert value(metrics, "workers_ready") == 2 and value(metrics, "steps_in_flight") == 1
    assert value(metrics, "lora_adapters_loaded") == 2
    assert value(metrics, "lora_loads_total") == 7
    assert value(metrics, "lora_evictions_total") == 5
    assert value(metrics, "requests_received_total") == 2
    assert value(metrics, "requests_rejected_total", code="INVALID_ARGUMENT") == 1
    assert value(metrics, "prompt_tokens_total") == 10                 # a and c started
    assert value(metrics, "prompt_tokens_cached_total") == 4
    assert value(metrics, "generation_tokens_total") == 4              # d's error: not here
    assert value(metrics, "request_success_total", finished_reason="stop", stop="string") == 1
    assert value(metrics, "request_success_total", finished_reason="stop", stop="token") == 1
    assert value(metrics, "request_success_total", finished_reason="error", stop="") == 1
    stats[0] = EngineStats()                                          # the engine lost its core
    assert value(metrics, "workers_ready") == 0 and value(metrics, "kv_cache_usage_perc") == 0
    prompt_rate, generation_rate = counters.rates()
    assert prompt_rate > 0 and generation_rate > 0


def test_request_token_buckets_follow_vllm():
    assert request_token_buckets(128) == (1, 2, 5, 10, 20, 50, 100)
    assert request_token_buckets(5) == (1, 2, 5)


def test_observe_many_counts_as_observing_one_by_one():
    from prometheus_client import CollectorRegistry, Histogram

    from scheduler_service.engine.metrics import ITL_BUCKETS, observe_many

    registry = CollectorRegistry()
    one = Histogram("one", "", buckets=ITL_BUCKETS, registry=registry)
    many = Histogram("many", "", buckets=ITL_BUCKETS, registry=registry)
    # On a bound, between bounds, below the first, above the last (the +Inf bucket), repeated.
    amounts = [0.01, 0.0125, 0.0, 0.05, 0.05, 0.3, 80.0, 100.0, 0.01]
    for a in amounts:
        one.observe(a)
    observe_many(many, amounts)
    observe_many(many, [])

    def samples(name):
        return {(s.name.removeprefix(name), tuple(sorted(s.labels.items()))): s.value
                for family in registry.collect() if family.name == name
                for s in family.samples if not s.name.endswith("_created")}

    ones, manys = samples("one"), samples("many")
    assert len(ones) == len(ITL_BUCKETS) + 1 + 2        # the buckets, +Inf, count and sum
    assert ones == pytest.approx(manys)
