"""Offline generation in one process: `LLM(model_dir).generate(prompts, sampling, stopping)`, and
`LLM.chat(messages, ...)` for prompts written as chats (rendered with the model's chat template).

The scheduler and one model runner share the process but talk only through encoded diffs, exactly
the bytes the gRPC worker protocol carries.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import random
import threading
from dataclasses import dataclass, field

import torch

from engine_common.text.chat_template import ChatMessage, load_chat_template
from engine_common.configuration.config import SchedulerConfig
from engine_common.configuration.speculative import to_json
from engine_common.constraints.constraint import Constraint
from engine_common.configuration.device_defaults import device_defaults
from engine_common.runtime.gc_heap import freeze_heap
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from engine_common.request.pooling import NO_POOLING
from engine_common.text.tokenizer import Tokenizer
from deltaserve.llm_chat import ChatOptions, call_template, chat_prompt_ids
from deltaserve.llm_embed import EmbedMixin, pooler_from_kwargs
from deltaserve.llm_score import ScoreMixin
from deltaserve.llm_executor import InProcessExecutor
from deltaserve.llm_interrupt import DeferredInterrupt
from deltaserve.llm_lora import LoRAMixin, lora_updates
from deltaserve.llm_inputs import conversations
from deltaserve.llm_requests import OfflineRequests, pooling_window
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.lora_updates import init_config
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.core.request import RequestStatus
from scheduler_service.core.scheduler import Scheduler
from worker_service.config import RunnerConfig
from worker_service.device_info import resolve_device
from worker_service.runner.model_runner import ModelRunner


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)   # TokenLogprob each; empty: none asked
    # vLLM's RequestOutput.prompt_logprobs: None first, then a PromptLogprob per prompt token
    # (None: not asked, num_prompt_logprobs None)
    prompt_logprobs: list | None = None
    finish_reason: RequestStatus | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None      # set when this request alone failed (finish_reason ABORTED)
    embedding: list[float] | None = None     # a pooling request's vector (LLM.embed)


class LLM(EmbedMixin, ScoreMixin, LoRAMixin):
    """Keyword arguments are the fields of RunnerConfig (the worker's: device, dtype,
    attention_backend, kv_cache_bytes, gpu_memory_utilization, num_kv_blocks, fused_ops, ...)
    and of SchedulerConfig (max_waiting, enable_prefix_caching, async_scheduling); the batch
    limits (max_num_seqs, max_num_batched_tokens, max_model_len, block_size) are shared.

    On CUDA the defaults of engine_common/configuration/device_defaults.py apply (async scheduling, a 16384
    token budget, fused norm and rope) unless given.

    `seed`, as vLLM's: requests without a seed of their own get seeds drawn from it (None:
    from the system, so unseeded sampling differs from run to run).

    KV-cache size: num_kv_blocks, else kv_cache_bytes, else on CUDA a profiled share of the GPU
    (`gpu_memory_utilization`, default 0.9, as the worker service does), else 1 GiB on CPU.

    `runner="pooling"` (vLLM's): an embedding model, served by embed() (llm_embed.py), pooled
    as `pooler_config` ({"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}) or the
    model directory says; a classification model, served by classify() and score()
    (llm_score.py)."""

    def __init__(self, model: str, *, seed: int | None = None, **kwargs):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not 0 <= seed < 2**63):
            raise ParamError("seed", seed, "None or an integer in [0, 2**63)")
        if "device" in kwargs:
            kwargs["device"] = resolve_device(kwargs["device"], "device")
        if isinstance(kwargs.get("speculative_config"), dict):     # vLLM's form: a dict
            kwargs["speculative_config"] = to_json(kwargs["speculative_config"])
        self.pooler = pooler_from_kwargs(model, kwargs)
        kwargs = {**device_defaults(kwargs.get("device", "cpu")), **kwargs}
        self.model_info = ModelInfo.from_dir(model, kwargs.get("max_model_len"))
        kwargs["max_model_len"] = self.model_info.max_model_len
        runner_keys = {f.name for f in dataclasses.fields(RunnerConfig)}
        sched_keys = {f.name for f in dataclasses.fields(SchedulerConfig)}
        unknown = set(kwargs) - runner_keys - sched_keys
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        runner_cfg = RunnerConfig(model_dir=model, **_default_budget(kwargs),
                                  **{k: v for k, v in kwargs.items() if k in runner_keys})
        sched_cfg = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in sched_keys})
        # as a worker's Init: with runtime updating or max_cpu_loras no adapter at start
        # (replay loads those the LRU holds) and at most the LRU's capacity
        self.runner = ModelRunner(init_config(runner_cfg))
        num_blocks = self.runner.determine_num_blocks()
        self.runner.init_kv_cache(num_blocks)
        self.tokenizer = Tokenizer.from_dir(model)
        self.model_info = self.model_info.with_tokenizer_eos(self.tokenizer.eos_token_id)
        self.chat_template = load_chat_template(model)
        self._model_dir = model
        # `seed` (vLLM's): the seeds drawn for requests without one follow from it, so a
        # script sampling without per-request seeds answers the same on every run.
        self._sched_cfg, self._num_blocks = sched_cfg, num_blocks
        self._rng = None if seed is None else random.Random(seed)
        self._lora = lora_updates(self.runner, sched_cfg)    # llm_lora.py
        if self._lora.cache is not None:
            self._lora.replay(first=True)     # the adapters the LRU holds at first
        self._build_engine()
        self._ids = itertools.count()
        self._failed: str | None = None      # a failed step's error: the LLM is done
        self._unsettled = None    # the executor a start-over closed, until its thread ended
        self._lock = threading.Lock()          # one call at a time (_exclusive)
        self._owner: int | None = None         # the thread in a call
        self._closed = False
        freeze_heap()     # keep the collector off torch, the model and the tokenizer

    def generate(self, prompts: str | list[int] | dict | list[str | list[int] | dict],
                 sampling: SamplingParams | list[SamplingParams] | None = None,
                 stopping: StoppingParams | list[StoppingParams] | None = None,
                 num_logprobs: int | None = None,
                 constraint: Constraint | list[Constraint | None] | None = None,
                 num_prompt_logprobs: int | None = None,
                 lora_request=None) -> list[Completion]:
        """Run every prompt to completion, batched together; results in prompt order. A prompt
        is a string, a list of token ids, {"prompt": str} or {"prompt_token_ids": ids}; one of
        them alone is a batch of one (as vLLM). `num_logprobs` as vLLM's SamplingParams.logprobs:
        None (the default) computes and returns none (Completion.logprobs stays empty); 0 each
        output token's own logprob; k that and its k best alternatives. `num_prompt_logprobs`
        as vLLM's SamplingParams.prompt_logprobs: None none; k (0 or more) each prompt token's
        logprob and rank and its position's k best alternatives, in Completion.prompt_logprobs
        (such prompts skip the prefix cache, as vLLM's). `constraint` (one for
        all, or one per prompt) is validated first (ParamError). `lora_request` (vLLM's): an
        adapter of lora_modules by name or as a LoRARequest, one for all or a list of one per
        prompt; None the base model (docs/lora.md). Calls from several threads run one after
        another."""
        self._check_generates()
        with self._exclusive("generate"):
            return self._generate(prompts, sampling, stopping, num_logprobs, constraint,
                                  num_prompt_logprobs, lora_request)

    def _generate(self, prompts, sampling, stopping, num_logprobs, constraint,
                  num_prompt_logprobs=None, lora_request=None,
                  pooling: int | list[int] = NO_POOLING) -> list[Completion]:
        """Run the call's prompts to completion, in prompt order. Each prompt's request is
        made as it is queued, while the waiting queue has room (max_waiting: a call with more
        prompts than that failed with QueueFull, as vLLM's never does) and, for a pooling
        call (embed, classify, score), while fewer than `pooling_window` are in the scheduler."""
        if self._failed is not None:
            raise RuntimeError("this LLM's model runner failed a step earlier and cannot run "
                               f"another ({self._failed}); build a new LLM") from None
        self._settle()
        calls = OfflineRequests(self, prompts, sampling, stopping, num_logprobs, constraint,
                                num_prompt_logprobs, lora_request, pooling)
        calls.check_admission(self.scheduler)
        # A finished request's tokens are its Completion's: not kept twice.
        results = {rid: Completion(rid, ids) for rid, ids in zip(calls.request_ids,
                                                                calls.prompt_ids)}
        order = []                        # queued so far
        pending = collections.deque(range(len(calls)))
        sched = self.scheduler
        limit = len(calls) if pooling == NO_POOLING else pooling_window(sched)

        def admit() -> None:
            while (pending and len(sched.waiting) < sched.config.max_waiting
                   and len(sched.waiting) + len(sched.running) < limit):
                request = calls.request(pending.popleft())
                order.append(request.request_id)
                self.engine.add_request(request)

        with DeferredInterrupt() as ctrl_c:     # Ctrl-C lands between steps
            try:
                admit()
                while pending or self.engine.has_unfinished_requests():
                    ctrl_c.check()
                    for out in self._step():
                        self._merge(results[out.request_id], out)
                    admit()
                self._drop_finished()
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt) and not ctrl_c.taken:
                    self._start_over()              # it landed inside a step
                    raise
                # A failed step, Ctrl-C between steps: none of this call's requests may stay
                # queued, holding blocks, for the next call to meet (KeyError, before).
                self.engine.abort(order)
                if self._failed is None:
                    self._drop_finished()
                raise
        return [results[rid] for rid in calls.request_ids]

    def _build_engine(self) -> None:
        """A scheduler (empty prefix cache) and its engine over the runner."""
        group = self.runner.window_group          # a hybrid model's (kv_groups.py)
        num_blocks = self._num_blocks if group is None else self.runner.kv_split(
            self._num_blocks)[0]
        self.scheduler = Scheduler(self._sched_cfg, num_blocks, self._rng,
                                   sliding_window=self.runner.sliding_window,
                                   window_group=group, vocab_size=self.model_info.vocab_size)
        # generate() reads only each request's result: one output per request, at its finish.
        self.engine = LLMEngine(EngineCore(self.scheduler, InProcessExecutor(self.runner),
                                           self._lora.registry, self._lora),
                                OutputProcessor(self.tokenizer, final_only=True))

    def _start_over(self) -> None:
        """After a KeyboardInterrupt inside a step (a second Ctrl-C; the first waits for the
        step's end): the scheduler and the runner may disagree on anything (a step counted
        that the runner never took, a diff half applied, a reply lost), so both start over, as
        the server does after a worker failure: a new scheduler and engine take over now (the
        prefix cache starts empty), and the runner drops every request once the runner thread
        ended the steps given to it (`_settle`, at the next call). Not waited for here: the
        second Ctrl-C is the way out of a step that does not end, and must raise at once."""
        executor = self.engine.core.executor
        executor.close(wait=False)
        self._unsettled = executor
        self._build_engine()
        if executor.ran_no_thread():       # nothing to wait for
            self._settle()

    def _settle(self) -> None:
        """The rest of a start-over: wait for the old runner thread, then the runner drops
        every request. Interrupted, the next call tries again."""
        if self._unsettled is not None:
            self._unsettled.wait_closed()
            self.runner.reset()
            self._unsettled = None

    def _step(self) -> list:
        try:
            return self.engine.step()
        except Exception as e:
            # The scheduler counted the step, the runner did not take it: every later step
            # would fail with a step-number mismatch, which says nothing.
            self._failed = f"{type(e).__name__}: {e}"
            raise

    def _drop_finished(self) -> None:
        """Tell the runner of the finished requests in a step that computes nothing (and
        collect any step still in flight), so generate() returns with nothing held: the
        runner's cached requests and batch rows lingered until the next call before."""
        while self.engine.has_work():
            self._step()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block, so the next generate() computes its prompts from
        scratch (benchmark rounds that repeat prompts). False, and nothing dropped, while a
        request holds blocks; generate() returns with none held."""
        with self._exclusive("reset_prefix_cache"):
            return self.scheduler.kv.reset_prefix_cache()

    @contextlib.contextmanager
    def _exclusive(self, call: str, closed_ok: bool = False):
        """One call at a time: one from another thread waits for the running one (two at once
        stepped the same engine, each meeting the other's outputs: KeyError, or a wrong
        result); one made inside a running call on its own thread could never run."""
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError(f"LLM.{call}() called inside a running LLM call on this thread")
        with self._lock:
            if self._closed and not closed_ok:
                raise RuntimeError(f"LLM.{call}(): this LLM is closed")
            self._owner = me
            try:
                yield
            finally:
                self._owner = None

    def close(self) -> None:
        """Free the model runner: its thread ends, its KV cache and this LLM's hold on the
        model go, and on CUDA their memory goes back to the device (torch.cuda.empty_cache()).
        Waits for a call running on another thread; later calls raise RuntimeError. Leaving a
        `with LLM(...) as llm:` block closes it; dropping the last reference ends the thread."""
        with self._exclusive("close", closed_ok=True):
            if self._closed:
                return
            self._closed = True
            self.engine.core.executor.close()
            if self._unsettled is not None:
                self._unsettled.wait_closed()
            self.runner.free_kv_cache()
            on_cuda = self.runner.device.type == "cuda"
            self.engine = self.runner = self.scheduler = self._lora = None   # _lora: the runner
            if on_cuda:     # the freed memory back to the device, for the next LLM's profiling
                torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # The pipeline's runner thread held the runner (the model, the KV cache) forever.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.core.executor.close(wait=False)

    def chat(self, messages: list[ChatMessage | dict] | list[list[ChatMessage | dict]],
             sampling: SamplingParams | list[SamplingParams] | None = None,
             stopping: StoppingParams | list[StoppingParams] | None = None,
             num_logprobs: int | None = None,
             constraint: Constraint | list[Constraint | None] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             num_prompt_logprobs: int | None = None) -> list[Completion]:
        """Answer one conversation (a list of messages: ChatMessage or {"role", "content"}
        dicts) or several (a list of such lists), each rendered with the model's chat template
        and its generation prompt, as the gRPC `messages` prompt is; OpenAI's text content parts
        are joined by newlines, as vLLM does. ParamError when the model has no chat template or
        the messages are not a conversation. One Completion per conversation.

        The keyword options are vLLM's LLM.chat's, rendered as transformers'
        apply_chat_template renders them: `chat_template` (Jinja text) instead of the model's,
        `add_generation_prompt`, `continue_final_message` (the prompt ends inside the final
        message, which the answer goes on with; needs add_generation_prompt=False), `tools`
        and `chat_template_kwargs` (more template variables, e.g. enable_thinking).
        `num_prompt_logprobs` as generate()'s, over the rendered prompt's ids."""
        options = ChatOptions(add_generation_prompt, continue_final_message, tools,
                              chat_template_kwargs)
        options.check()
        template = call_template(self.chat_template, chat_template, self._model_dir)
        prompts = []
        for i, conv in enumerate(conversations(messages)):
            try:
                prompts.append(chat_prompt_ids(self.tokenizer, template, conv, options,
                                               repr(self.model_info.name)))
            except (TypeError, KeyError, AttributeError, IndexError) as e:
                # A template's own Python failing on these messages: the caller's to fix.
                raise ParamError(f"messages (conversation {i})", f"{len(conv)} messages",
                                 f"accepted by the model's chat template (it failed: "
                                 f"{type(e).__name__}: {e})") from None
        return self.generate(prompts, sampling, stopping, num_logprobs, constraint,
                             num_prompt_logprobs=num_prompt_logprobs)

    @staticmethod
    def _merge(done: Completion, out) -> None:
        """Add `out` to `done`: the final output alone (a final-only processor), or each
        per-step output in turn (any other processor put in its place)."""
        done.token_ids.extend(out.new_token_ids)
        done.text += out.new_text
        done.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            done.prompt_logprobs = list(out.prompt_logprobs)   # built here, once
        done.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            done.finish_reason = out.finish_reason
            done.stop_reason = out.stop_reason
            done.error = None if out.error is None else str(out.error)
            done.embedding = out.embedding


def _default_budget(kwargs: dict) -> dict:
    """On CUDA with no KV budget given, a profiled 0.9 of the device, as the worker service."""
    budgets = {"num_kv_blocks", "kv_cache_bytes", "gpu_memory_utilization"}
    if budgets & set(kwargs) or not str(kwargs.get("device", "cpu")).startswith("cuda"):
        return {}
    return {"gpu_memory_utilization": 0.9}
