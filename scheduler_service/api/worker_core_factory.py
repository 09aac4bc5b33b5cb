"""`make_core` of the scheduler service's AsyncEngine: Init the workers (a new epoch), load the
LoRA adapters served now (engine/lora_updates.py), then a fresh EngineCore."""
from __future__ import annotations

import logging

from engine_common.configuration.config import SchedulerConfig
from scheduler_service.core.kv_events import KvEventFeed
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.lora_updates import LoRAUpdates
from scheduler_service.errors import EngineUnavailable
from scheduler_service.workers.worker_client import InitSpec, WorkerClient

log = logging.getLogger(__name__)


class WorkerCoreFactory:
    """`make_core` for AsyncEngine: Init the workers (new epoch), then a fresh EngineCore."""

    def __init__(self, client: WorkerClient, spec: InitSpec, config: SchedulerConfig,
                 kv_events: KvEventFeed | None = None, lora: LoRAUpdates | None = None,
                 vocab_size: int | None = None):
        """`vocab_size`: the model's, which every sampled id of a step reply must be below."""
        self.client = client
        self.vocab_size = vocab_size
        self.lora = lora      # runtime LoRA adapters: loaded again after every Init
        self.spec = spec
        self.config = config
        self.kv_events = kv_events
        self._last_error = ""
        self._was_ready = False
        self._num_ranks = 0

    def tp_size(self) -> int:
        """Ranks of the last successful Init (0 before the first)."""
        return self._num_ranks

    def __call__(self) -> EngineCore:
        try:
            result = self.client.init(self.spec)
            if self.lora is not None and (self.lora.allowed or self.lora.cache is not None):
                # the adapters served now (with --max-cpu-loras: those it holds)
                self.lora.replay(first=not self._was_ready)
        except EngineUnavailable as e:
            self._log_once(str(e))
            raise
        except Exception as e:  # e.g. a worker refused the model: keep retrying, say why
            self._log_once(f"{type(e).__name__}: {e}")
            raise EngineUnavailable(f"worker Init failed: {e}") from e
        self._last_error = ""
        self._was_ready = True
        self._num_ranks = len(result.devices)
        scheduler = Scheduler(self.config, result.num_kv_blocks, kv_events=self.kv_events,
                              sliding_window=result.sliding_window,
                              window_group=result.window_group, vocab_size=self.vocab_size)
        _warn_if_cache_cuts_requests(scheduler.max_len, self.config)
        # Three in flight only when every node pipelines (an older build's Init lacks the field:
        # two); EngineCore keeps two with speculative decoding whatever it is asked.
        core = EngineCore(scheduler, self.client,
                          None if self.lora is None else self.lora.registry, self.lora,
                          steps_in_flight=3 if result.pipelined and self.config.async_scheduling
                          else 2)
        pipelined = ""
        if result.pipelined:
            pipelined = "; they pipeline their steps"
            if self.config.async_scheduling:
                pipelined += f" ({core.steps_in_flight} in flight)"
        log.info("workers initialized: %d KV blocks of %d tokens, KV cache %s (what they "
                 "allocated, fp8 resolved)%s", result.num_kv_blocks, self.config.block_size,
                 result.kv_cache_dtype, pipelined)
        return core

    def check_health(self, core: EngineCore) -> None:
        """Raise EngineUnavailable when a worker is gone or lost its model (restarted), Fenced
        when another scheduler took one over; run by the engine thread while idle."""
        health = self.client.health()
        self.client.check_owner(health)
        bad = [f"{h.address}: {h.reason or 'not ready'}" for h in health if not h.ready]
        if bad:
            raise EngineUnavailable("worker not ready: " + "; ".join(bad))

    def _log_once(self, message: str) -> None:
        """Each new reason once; at startup (workers still loading) as INFO, later as WARNING."""
        if message != self._last_error:
            level = logging.WARNING if self._was_ready else logging.INFO
            log.log(level, "waiting for the workers: %s", message)
            self._last_error = message


def _warn_if_cache_cuts_requests(capacity: int, config: SchedulerConfig) -> None:
    """A request longer than the whole KV cache ends there ("length", fewer tokens than its
    max_tokens asked): say so once per Init where max_model_len allows such requests (vLLM
    refuses to start then). `capacity`: the scheduler's max_len (a model with a sliding window
    on every layer may outgrow the cache: sliding_window.max_request_len)."""
    if config.max_model_len is not None and capacity < config.max_model_len:
        log.warning("the KV cache holds %d tokens, fewer than max_model_len %d: a request "
                    "whose prompt and output outgrow it ends at %d tokens with finish_reason "
                    "length whatever its max_tokens; lower --max-model-len or give the cache "
                    "more (--kv-cache-gib, --gpu-memory-utilization)", capacity,
                    config.max_model_len, capacity)
