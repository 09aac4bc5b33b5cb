"""The scheduler's Prometheus metrics: vLLM's names and meanings where vLLM has the metric, with
the prefix `deltaserve:` instead of `vllm:`, every series labelled by `model_name`.

NOTE who records what (each number has one owner):
- gauges, and the request and token counters, are read at scrape time from two objects that
  GetServerStatus reads too: the engine thread's EngineStats snapshot and the serving side's
  ServingCounters (`_Snapshots` below);
- request latencies and lengths are histograms the stream hub observes once per hand-off;
- per-step histograms and the engine's own counters (preemptions, prefix cache, epochs, worker
  failures) are recorded on the engine thread after each step.
docs/metrics.md ("The metrics, name by name") lists every name; a test compares it with a real scrape.
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import Counter as Tally
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from scheduler_service.core.kv_cache_manager import PrefixCacheStats
from scheduler_service.engine.engine_core import StepStats
from scheduler_service.engine.engine_stats import EngineStats
from scheduler_service.engine.output_processor import RequestOutput
from scheduler_service.engine.serving_counters import ServingCounters
from scheduler_service.engine.spec_metrics import SpecMetrics
from scheduler_service.errors import EngineUnavailable, WorkerFailure

PREFIX = "deltaserve:"

# vLLM's bucket families (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = tuple(2 ** i for i in range(15)) + (16384,)
# Ours: one scheduler step's phases, requests per step, diff bytes per step.
STEP_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                        0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = tuple(2 ** i for i in range(13))
DIFF_BYTES_BUCKETS = tuple(4 ** i for i in range(2, 12))
STEP_PHASES = ("schedule", "round_trip", "update", "output_processing")


def request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to max_model_len."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class SchedulerMetrics:
    """Every scheduler metric in its own registry (several engines can live in one process)."""

    def __init__(self, model_name: str, max_model_len: int = 32768):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._lock = threading.Lock()
        self._token_times: dict[str, tuple[float, float]] = {}   # request -> (first, last)
        self._prefix_seen: tuple[int, int] = (0, 0)   # this epoch's (queries, hits) so far
        self._phases: dict = {}     # phase -> step_phase's child, made at its first observation
        self._spec: SpecMetrics | None = None      # made at the first step that drafts
        self._make_request_histograms(request_token_buckets(max_model_len))
        self._make_step_metrics()

    def _histogram(self, name: str, doc: str, buckets, *labels: str):
        metric = Histogram(PREFIX + name, doc, ["model_name", *labels], buckets=buckets,
                           registry=self.registry)
        return metric if labels else metric.labels(self.model_name)

    def _counter(self, name: str, doc: str, *labels: str):
        metric = Counter(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)
        return metric if labels else metric.labels(self.model_name)

    def _make_request_histograms(self, token_buckets) -> None:
        h = self._histogram
        self.ttft = h("time_to_first_token_seconds", "Histogram of time to first token in "
                      "seconds.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Histogram of inter-token latency in "
                     "seconds.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Histogram of e2e request latency in "
                     "seconds.", LATENCY_BUCKETS)
        self.queue = h("request_queue_time_seconds", "Histogram of time spent in WAITING phase "
                       "for request.", LATENCY_BUCKETS)
        self.prefill = h("request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                         "phase for request.", LATENCY_BUCKETS)
        self.decode = h("request_decode_time_seconds", "Histogram of time spent in DECODE phase "
                        "for request.", LATENCY_BUCKETS)
        self.inference = h("request_inference_time_seconds", "Histogram of time spent in "
                           "RUNNING phase for request.", LATENCY_BUCKETS)
        self.prompt_len = h("request_prompt_tokens", "Number of prefill tokens processed.",
                            token_buckets)
        self.generation_len = h("request_generation_tokens", "Number of generation tokens "
                                "processed.", token_buckets)

    def _make_step_metrics(self) -> None:
        h, c = self._histogram, self._counter
        self.step_phase = h("step_duration_seconds", "Seconds of one scheduler step by phase: "
                            "schedule, round_trip (waiting for the workers), update (the "
                            "reply into token updates), output_processing (text, on the "
                            "event loop).", STEP_SECONDS_BUCKETS, "phase")
        self.iteration_tokens = h("iteration_tokens_total", "Histogram of number of tokens per "
                                  "engine_step.", ITERATION_TOKEN_BUCKETS)
        self.batch_size = h("step_batch_size", "Requests scheduled with tokens per step.",
                            BATCH_BUCKETS)
        self.diff_bytes = h("step_diff_bytes", "Bytes of the encoded SchedulerOutput diff per "
                            "step.", DIFF_BYTES_BUCKETS)
        self.preemptions = c("num_preemptions", "Cumulative number of preemption from the "
                             "engine.")
        self.prefix_queries = c("prefix_cache_queries", "Prefix cache queries, in terms of "
                                "number of queried tokens.")
        self.prefix_hits = c("prefix_cache_hits", "Prefix cache hits, in terms of number of "
                             "cached tokens.")
        self.epochs = c("epochs_started", "Engine epochs started (the workers initialized "
                        "again after a failure, and the first time).")
        self.step_failures = c("step_failures", "Engine steps failed by a worker (each ends "
                               "the epoch), by kind.", "kind")

    def attach(self, stats: Callable[[], EngineStats], counters: ServingCounters,
               num_workers: int) -> None:
        """Expose the gauges and the request counters of `stats()` and `counters`."""
        self.registry.register(_Snapshots(self.model_name, stats, counters, num_workers))

    # -- the serving side, once per hand-off --------------------------------------------------

    def observe_outputs(self, outputs: list[RequestOutput], output_processing_s: float) -> None:
        """One hand-off's outputs: time to first token, inter-token latency (both observed in
        bulk: one hand-off holds an output of every running request), and each finish."""
        now = time.monotonic()
        self._phase("output_processing").observe(output_processing_s)
        first, gaps = [], []
        with self._lock:
            times = self._token_times
            for out in outputs:
                rid = out.request_id
                if out.error is not None:
                    times.pop(rid, None)
                    continue
                if out.new_token_ids:
                    seen = times.get(rid)
                    if seen is None:
                        first.append(now - out.timings.arrival_time)
                        times[rid] = (now, now)
                    else:
                        gaps.append(now - seen[1])
                        times[rid] = (seen[0], now)
                if out.finished:
                    self._observe_finish(out, now)
        observe_many(self.ttft, first)
        observe_many(self.itl, gaps)

    def _observe_finish(self, out: RequestOutput, now: float) -> None:
        t = out.timings
        first, last = self._token_times.pop(out.request_id, (None, None))
        self.e2e.observe(now - t.arrival_time)
        self.prompt_len.observe(out.num_prompt_tokens)
        self.generation_len.observe(out.num_output_tokens)
        if t.first_scheduled_time is None:
            return
        self.queue.observe(max(0.0, t.first_scheduled_time - t.arrival_time))
        if first is not None:
            self.prefill.observe(max(0.0, first - t.first_scheduled_time))
            self.decode.observe(last - first)
            self.inference.observe(max(0.0, last - t.first_scheduled_time))

    def forget(self, request_id: str) -> None:
        """A stream that ended with an error: drop its token times."""
        with self._lock:
            self._token_times.pop(request_id, None)

    # -- the engine thread, once per step ------------------------------------------------------

    def observe_step(self, step: StepStats, prefix: PrefixCacheStats, spec=None) -> None:
        """`spec`: the scheduler's SpecStats when it drafts."""
        phase = self._phase
        if step.diff_bytes:
            phase("schedule").observe(step.schedule_s)
            self.diff_bytes.observe(step.diff_bytes)
            self.batch_size.observe(step.num_reqs)
            self.iteration_tokens.observe(step.num_tokens)
        if step.round_trip_s:
            phase("round_trip").observe(step.round_trip_s)
            phase("update").observe(step.update_s)
        if step.num_preempted:
            self.preemptions.inc(step.num_preempted)
        self._observe_prefix_cache(prefix)
        if spec is not None:
            if self._spec is None:
                self._spec = SpecMetrics(self.registry, PREFIX, self.model_name)
            self._spec.observe(spec)

    def _phase(self, name: str):
        """step_phase's child for `name` (labels() costs a few us; two threads may both make
        it the first time: prometheus_client hands both the same child)."""
        child = self._phases.get(name)
        if child is None:
            child = self._phases[name] = self.step_phase.labels(self.model_name, name)
        return child

    def _observe_prefix_cache(self, prefix: PrefixCacheStats) -> None:
        """The KV manager's counts restart with each epoch's scheduler: add the increase."""
        queries, hits = self._prefix_seen
        self.prefix_queries.inc(max(0, prefix.queries - queries))
        self.prefix_hits.inc(max(0, prefix.hits - hits))
        self._prefix_seen = (prefix.queries, prefix.hits)

    def observe_epoch(self) -> None:
        """A new engine core (the engine thread, before its first step)."""
        self.epochs.inc()
        self._prefix_seen = (0, 0)
        if self._spec is not None:
            self._spec.reset()

    def observe_failure(self, error: BaseException) -> None:
        """A failed engine step (the streams of the epoch failed with it)."""
        if isinstance(error, WorkerFailure):
            kind = error.kind
        else:
            kind = "unavailable" if isinstance(error, EngineUnavailable) else "internal"
        self.step_failures.labels(self.model_name, kind).inc()


def observe_many(histogram: Histogram, amounts: list[float]) -> None:
    """`histogram.observe(a)` for every a in `amounts`, with one update per bucket hit instead
    of one per amount (prometheus_client keeps a count per bucket, the first whose bound is >=
    the amount, and a sum). Without those internals (another prometheus_client), one by one."""
    if not amounts:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:
        for amount in amounts:
            histogram.observe(amount)
        return
    for i, n in Tally(bisect_left(bounds, a) for a in amounts).items():
        buckets[i].inc(n)
    total.inc(sum(amounts))


class _Snapshots:
    """Gauges and counters read at scrape time from the objects GetServerStatus reads."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 counters: ServingCounters, num_workers: int):
        self._model = model_name
        self._stats = stats
        self._counters = counters
        self._num_workers = num_workers

    def collect(self):
        s, c, m = self._stats(), self._counters.snapshot(), [self._model]
        for name, doc, value in (
                ("num_requests_running", "Number of requests in model execution batches.",
                 s.num_running),
                ("num_requests_waiting", "Number of requests waiting to be processed.",
                 s.num_waiting),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 s.kv_cache_usage),
                ("kv_blocks_used", "KV-cache blocks held by live requests.", s.num_used_blocks),
                ("kv_blocks_total", "KV-cache blocks on every worker rank.", s.num_total_blocks),
                ("kv_window_blocks_used", "A hybrid model's window-group KV blocks held by "
                 "live requests (0 for another model).", s.num_used_window_blocks),
                ("kv_window_blocks_total", "A hybrid model's window-group KV blocks (0 for "
                 "another model).", s.num_total_window_blocks),
                ("workers_ready", "Worker services initialized in the current epoch.",
                 s.num_workers_ready(self._num_workers)),
                ("steps_in_flight", "Steps sent to the workers and not collected yet.",
                 s.num_steps_in_flight),
                ("lora_adapters_loaded", "LoRA adapters loaded on the workers "
                 "(--max-cpu-loras or runtime updating; 0 without either).", s.num_loras_loaded)):
            yield _gauge(name, doc, m, value)
        yield from _request_counters(m, c)
        yield from _lora_counters(m, s)


def _lora_counters(m: list[str], s: EngineStats):
    for name, doc, value in (
            ("lora_loads", "LoRA adapters --max-cpu-loras loaded on the workers (at start, "
             "and each one read again).", s.num_lora_loads),
            ("lora_evictions", "LoRA adapters --max-cpu-loras freed on the workers to make "
             "room for another.", s.num_lora_evictions)):
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric(m, value)
        yield family


def _gauge(name: str, doc: str, labels: list[str], value) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _request_counters(m: list[str], c):
    for name, doc, value in (
            ("requests_received", "Requests received (Generate calls of deltaserve.v1 and "
             "VllmEngine; one per choice).", c.received),
            ("prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens),
            ("prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
             c.cached_prompt_tokens),
            ("generation_tokens", "Number of generation tokens processed.",
             c.generation_tokens),
            ("streams_stalled", "Generate streams cut because their client read none of "
             "their output for --stream-send-timeout seconds (the request aborted, its KV "
             "blocks freed).", c.stalled)):
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric(m, value)
        yield family
    success = CounterMetricFamily(PREFIX + "request_success", "Count of successfully processed "
                                  "requests.", labels=["model_name", "finished_reason", "stop"])
    for (reason, stop), n in sorted(c.finished.items()):
        success.add_metric(m + [reason, stop], n)
    yield success
    rejected = CounterMetricFamily(PREFIX + "requests_rejected", "Requests whose call ended "
                                   "with an error status before their first output, by status "
                                   "code.", labels=["model_name", "code"])
    for code, n in sorted(c.rejected.items()):
        rejected.add_metric(m + [code], n)
    yield rejected
