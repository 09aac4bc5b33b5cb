"""vLLM's speculative decoding counters (vllm:spec_decode_*), with our prefix, and ours of the
drafts the workers dropped: registered at the first step of an engine that drafts
(docs/speculative-decoding.md, docs/metrics.md)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from scheduler_service.core.spec_decode import SpecStats


class SpecMetrics:
    """The counters, fed from the scheduler's SpecStats after each step. The scheduler's counts
    restart with each epoch (a new scheduler): only their increase is added."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str):
        def counter(name: str, doc: str, *labels: str):
            return Counter(prefix + name, doc, ["model_name", *labels], registry=registry)
        self._model = model_name
        self.drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts "
                              "(requests given drafts in a step).").labels(model_name)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft "
                                    "tokens.").labels(model_name)
        self.accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted "
                                "tokens.").labels(model_name)
        self.per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per "
                               "draft position.", "position")
        # Ours (vLLM's async scheduling drafts nothing over the step in flight).
        self.dropped = counter("spec_decode_num_dropped_drafts", "Requests-steps whose drafts "
                               "the workers dropped (async scheduling: the guess over the step "
                               "in flight failed).").labels(model_name)
        self.reset()

    def reset(self) -> None:
        """A new epoch: its scheduler counts from zero."""
        self._seen = SpecStats()

    def observe(self, stats: SpecStats) -> None:
        """Add what the scheduler counted since the last call (of this epoch)."""
        seen = self._seen
        self.drafts.inc(max(0, stats.num_drafts - seen.num_drafts))
        self.draft_tokens.inc(max(0, stats.num_draft_tokens - seen.num_draft_tokens))
        self.accepted.inc(max(0, stats.num_accepted_tokens - seen.num_accepted_tokens))
        self.dropped.inc(max(0, stats.num_dropped - seen.num_dropped))
        before = seen.accepted_per_pos + [0] * len(stats.accepted_per_pos)
        for pos, n in enumerate(stats.accepted_per_pos):
            if n > before[pos]:
                self.per_pos.labels(self._model, str(pos)).inc(n - before[pos])
        self._seen = SpecStats(stats.num_drafts, stats.num_draft_tokens,
                               stats.num_accepted_tokens, list(stats.accepted_per_pos),
                               stats.num_dropped)
