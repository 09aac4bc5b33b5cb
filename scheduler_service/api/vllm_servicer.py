"""vllm.grpc.engine.VllmEngine: vLLM's gRPC engine protocol, so the Shepherd Model Gateway (and
anything else written against vLLM's gRPC server) can front DeltaServe.

A thin adapter over the same AsyncEngine, tokenizer and model as deltaserve.v1.Generation, on the
same port, behind the same guards: the port's TLS and API keys (guard.py), the request limits
(request_limits.py, checked before anything costly) and the shared tokenizer pool; vllm_convert.py
does the protobuf. One Generate call is one request, or n requests for
`n` > 1 (engine ids `<request_id>-<i>`, sharing the prompt's cached blocks; every message carries
its choice `index`; not streamed, the choices' `complete`s come in index order once all are
done). Abort(request_ids) finds them by the caller's id, and ends only requests
made with the caller's API key; cancelling the call aborts them too. Every failure becomes a
status through status.status_for (a field we cannot honour is
INVALID_ARGUMENT naming it). FlushCache empties the prefix cache once no request is running.
Embed serves a --runner pooling server (embeddings.py); the profiler RPCs are UNIMPLEMENTED.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from contextlib import aclosing
from datetime import datetime, timezone
from typing import AsyncIterator, Callable

import grpc

from engine_common.request.params import ParamError, clip
from engine_common.wire.protos import smg_common_pb2 as cpb
from engine_common.wire.protos import vllm_engine_pb2 as pb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.convert import OFF_LOOP_TOKENS
from scheduler_service.api.embeddings import embed_in_place, prompt_of
from scheduler_service.api.front_door import (FrontDoor, ServedModel, ValidatedRequest,
                                              abort_requests, abort_with, new_request_id)
from scheduler_service.api.api_keys import KeyBook
from scheduler_service.api.guard import caller_of, policy_of, pool_caller, scoped_id
from scheduler_service.api.request_quota import RequestQuota
from scheduler_service.api.tokenizer_bundle import (TokenizerBundle, build_tokenizer_bundle,
                                                    chunks)
from scheduler_service.api.request_limits import check_abort_ids
from scheduler_service.api.request_tally import RequestTally
from scheduler_service.api.stream_sends import SendWatch, send_watch
from scheduler_service.api.tokenizer_pool import TokenizerPool
from scheduler_service.api.vllm_convert import (EngineShape, child_sampling,
                                                chunk_to_proto, complete_to_proto,
                                                input_logprobs_to_proto,
                                                kv_batch_to_proto, limited_fields,
                                                model_info_to_proto,
                                                request_from_proto, scheduler_load_to_proto,
                                                server_info_to_proto)
from scheduler_service.core.request import Request
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.kv_event_publisher import KvEventPublisher, SubscriberLagging
from scheduler_service.engine.output_processor import RequestOutput, TokenLogprob
from scheduler_service.errors import StalledClient

log = logging.getLogger(__name__)

TOKENIZER_CHUNK_BYTES = 64 * 1024
MAX_FLUSH_WAIT_SECONDS = 3600.0
VERSION = "deltaserve-0.1.0"
# An Abort's log line names at most this many of its ids (it may carry millions, each with any
# characters: one line of several MB, or a forged line after a newline, before).
_LOGGED_ABORT_IDS = 8


class _Choice:
    """What one choice of a non-streamed request produced so far."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs = None       # its prompt logprobs, once they came


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """`is_ready()`: the service's readiness (workers initialized, not draining);
    `tokenizer_pool`: shared with the port's other services (a pool of its own if None);
    `keys`: what each API key may do (its cache salt, its default priority); `adapter`: a
    LoRA adapter's own port (adapter_ports.py): its name is the model's, and every Generate
    runs it."""

    def __init__(self, engine: AsyncEngine, model: ServedModel, shape: EngineShape,
                 kv_events: KvEventPublisher, is_ready: Callable[[], bool],
                 options: ApiOptions = ApiOptions(), tokenizer_pool: TokenizerPool | None = None,
                 keys: KeyBook = KeyBook(), quota: RequestQuota | None = None,
                 adapter: str | None = None, sends: SendWatch | None = None):
        self._engine = engine
        self._sends = sends or send_watch(options, engine)   # --stream-send-timeout
        self._adapter = adapter
        self._options = options
        self._keys = keys
        self._door = FrontDoor(model, options, tokenizer_pool, quota)
        self._model = model
        self._shape = shape
        self._kv_events = kv_events
        self._is_ready = is_ready
        self._start_time = time.time()
        self._last_receive = 0.0
        # scoped_id(caller, the caller's id) -> (caller_of() its Generate, engine request ids)
        self._children: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._tokenizer_bundle: TokenizerBundle | None = None

    # -- Generate ---------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        """Chunks per step while streaming, then one `complete` per choice, each write waiting
        at most --stream-send-timeout for the client (stream_sends.py). Counted in the
        request counters as deltaserve.v1's Generate is (`RequestTally`)."""
        tally = RequestTally(self._engine.counters)
        writing, first = False, True
        try:
            self._model.check_runner("Generate")
            policy, caller = policy_of(context, self._keys), caller_of(context)
            # no priority field: the key's default, never outside its priority= range
            inp = dataclasses.replace(self._validate(request), priority=policy.default_priority)
            tally.choices(inp.n)
            self._last_receive = time.time()
            # The places first: a key at its bound is refused before it costs tokenizer time.
            with self._door.quota.hold(caller, inp.request_id, inp.n):
                prompt_ids = await self._door.prompt_ids(inp, pool_caller(context))
                async with aclosing(self._run(inp, prompt_ids, caller, policy.salt, tally)) as msgs:
                    async for msg in msgs:
                        writing = True
                        await self._sends.write(context, msg, first)
                        writing = first = False
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every failure becomes one status, through one function
            if writing and not isinstance(e, StalledClient):   # grpc's error: the call is over
                raise
            tally.failed(e)
            await abort_with(context, e)

    def _validate(self, msg: pb.GenerateRequest) -> ValidatedRequest:
        """Limits first, then the conversion; nothing costly yet (the constraint is validated
        and a text prompt tokenized on the pool by FrontDoor.prompt_ids)."""
        info = self._model.info
        self._door.check_limits(msg, limited_fields(msg))
        inp = request_from_proto(msg, defaults=self._model.default_sampling,
                                 vocab_size=info.vocab_size,
                                 max_logprobs=self._options.max_logprobs)
        if self._adapter is not None:
            inp = dataclasses.replace(inp, lora_name=self._adapter)
        return inp

    async def _run(self, inp: ValidatedRequest, prompt_ids: list[int], caller: str,
                   cache_salt: str, tally: RequestTally) -> AsyncIterator[pb.GenerateResponse]:
        """The choices' messages; the caller holds their places (n of the key's)."""
        key = scoped_id(caller, inp.request_id)     # each API key has its own ids
        max_waiting = self._shape.max_waiting
        if max_waiting is not None and inp.n > max_waiting:
            raise ParamError("sampling_params.n", inp.n,
                             f"<= max_waiting ({max_waiting}): the choices queue together")
        ids = (key,) if inp.n == 1 else tuple(f"{key}-{i}" for i in range(inp.n))
        if key in self._children:
            raise ParamError("request_id", inp.request_id, "not the id of a running request")
        self._children[key] = (caller, ids)
        try:
            async with aclosing(self._choices(inp, ids, prompt_ids, cache_salt,
                                              tally)) as msgs:
                async for msg in msgs:
                    yield msg
        finally:
            self._children.pop(key, None)

    async def _choices(self, inp: ValidatedRequest, ids: tuple[str, ...], prompt_ids: list[int],
                       cache_salt: str, tally: RequestTally) -> AsyncIterator[pb.GenerateResponse]:
        requests = [self._door.engine_request(inp, rid, prompt_ids, cache_salt,
                                              child_sampling(inp.sampling, i))
                    for i, rid in enumerate(ids)]
        choices = [_Choice() for _ in ids]
        finals: dict[int, pb.GenerateResponse] = {}
        eos = None if inp.stopping.ignore_eos else self._model.tokenizer.eos_token_id
        async for index, out in self._outputs(requests):
            tally.output(out)
            if not _builds_off_loop(inp, out, choices[index]):
                msgs = _messages(inp, index, out, choices[index], eos, prompt_ids)
            else:       # prompt logprobs take seconds for a long prompt: off the event loop
                msgs = await asyncio.to_thread(_messages, inp, index, out, choices[index],
                                               eos, prompt_ids)
            for msg in msgs:
                if inp.stream:
                    yield msg
                else:
                    finals[index] = msg
        # Not streamed: the choices in index order, as vLLM sends them; the gateway numbers
        # them by arrival, not by their `index`.
        for index in sorted(finals):
            yield finals[index]

    async def _outputs(self, requests: list[Request]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them; one request needs no merging."""
        if len(requests) == 1:
            async for out in self._engine.generate(requests[0]):
                yield 0, out
            return
        async for item in _merge([self._engine.generate(r) for r in requests]):
            yield item

    # -- management -------------------------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        """Abort by the callers' ids (every choice of an n > 1 request); unknown ids, and ids of
        requests made with another API key, are ignored; more ids than MAX_ABORT_IDS:
        INVALID_ARGUMENT."""
        try:
            check_abort_ids(request.request_ids)
        except ParamError as e:
            await abort_with(context, e)
        caller = caller_of(context)
        owned = [self._children.get(scoped_id(caller, rid)) for rid in request.request_ids]
        ids = [cid for entry in owned if entry is not None and entry[0] == caller
               for cid in entry[1]]
        asked = request.request_ids      # the client's strings: quoted, and only the first few
        log.info("Abort of %d ids: %s", len(asked),
                 clip(", ".join(repr(rid) for rid in asked[:_LOGGED_ABORT_IDS])))
        await abort_requests(self._engine, ids, context)
        return pb.AbortResponse()

    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        """Our readiness: every worker initialized and not draining."""
        if self._is_ready():
            return pb.HealthCheckResponse(healthy=True, message="ready")
        reason = self._engine.last_error if not self._engine.ready else "draining"
        return pb.HealthCheckResponse(healthy=False, message=f"not ready: {reason}")

    async def FlushCache(self, request: cpb.FlushCacheRequest,
                         context) -> cpb.FlushCacheResponse:
        """Forget every cached prompt block. timeout_s 0: only if no request is running now
        (success false otherwise); else wait up to timeout_s seconds for the engine to go
        idle. The message says why a flush did not happen."""
        timeout_s = request.timeout_s
        if not (math.isfinite(timeout_s) and 0 <= timeout_s <= MAX_FLUSH_WAIT_SECONDS):
            await abort_with(context, ParamError(
                "timeout_s", timeout_s, f">= 0 and <= {MAX_FLUSH_WAIT_SECONDS:g} seconds"))
        flushed, message = await asyncio.wrap_future(self._engine.flush_prefix_cache(timeout_s))
        log.info("FlushCache(timeout_s=%g): %s", timeout_s, message)
        return cpb.FlushCacheResponse(success=flushed, message=message)

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        m = self._model
        info = m.info if self._adapter is None else dataclasses.replace(m.info, name=self._adapter)
        return model_info_to_proto(info, m.tokenizer.bos_token_id, m.default_sampling)

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        stats = self._engine.stats
        return server_info_to_proto(stats.num_running + stats.num_waiting,
                                    time.time() - self._start_time, self._last_receive,
                                    self._shape)

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        """One SchedulerLoad (this replica is data-parallel rank 0)."""
        loads = []
        if not request.HasField("dp_rank") or request.dp_rank == 0:
            loads.append(scheduler_load_to_proto(self._engine.stats, self._engine.throughput()[1],
                                                 self._shape))
        return pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(),
                                   version=VERSION, dp_rank_count=1, loads=loads)

    async def GetTokenizer(self, request, context) -> AsyncIterator[cpb.GetTokenizerChunk]:
        """The tokenizer files as one zip in 64 KiB chunks; the last carries its sha256."""
        try:
            bundle = await self._bundle()
        except Exception as e:
            await abort_with(context, e)
        pieces = chunks(bundle.data, TOKENIZER_CHUNK_BYTES)
        for i, piece in enumerate(pieces):
            yield cpb.GetTokenizerChunk(data=piece,
                                        sha256=bundle.sha256 if i == len(pieces) - 1 else "")

    async def _bundle(self) -> TokenizerBundle:
        if self._tokenizer_bundle is None:   # the files do not change while we serve
            self._tokenizer_bundle = await asyncio.to_thread(build_tokenizer_bundle,
                                                             self._model.info.path)
        return self._tokenizer_bundle

    async def SubscribeKvEvents(self, request, context) -> AsyncIterator[cpb.KvEventBatch]:
        """The prefix cache's stored/removed blocks from now on, one batch per engine step."""
        await context.send_initial_metadata(())
        announced: set[int] = set()        # this stream's KV groups whose kind it has sent
        try:
            async for batch in self._kv_events.subscribe():
                yield kv_batch_to_proto(batch, announced)
        except SubscriberLagging as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    # -- not served -------------------------------------------------------------------------

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        """One prompt's vector, on a --runner pooling server (FAILED_PRECONDITION on a
        generating one, and Generate there): tokenized.input_ids, else original_text
        tokenized here. Counted in the request counters as a Generate is."""
        tally = RequestTally(self._engine.counters)
        try:
            self._model.check_runner("Embed")
            if self._adapter is not None:      # it would run the base model under its name
                raise ParamError("model", self._adapter, "the base model's port: embeddings "
                                 "run no LoRA adapter")
            caller = caller_of(context)
            tokenized = request.tokenized
            rid = request.request_id or new_request_id()
            with self._door.quota.hold(caller, rid):       # before tokenizing
                ids = await prompt_of(self._door, tokenized.input_ids,
                                      tokenized.original_text, pool_caller(context))
                self._last_receive = time.time()
                vector = await embed_in_place(self._engine, self._door, caller, rid, ids,
                                              policy_of(context, self._keys), tally.output)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes one status
            tally.failed(e)
            await abort_with(context, e)
        return pb.EmbedResponse(embedding=vector, prompt_tokens=len(ids),
                                embedding_dim=len(vector))

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StartProfile is not supported")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile is not supported")


def _messages(inp: ValidatedRequest, index: int, out: RequestOutput, choice: _Choice,
              eos_token_id: int | None, prompt_ids: list[int]) -> list[pb.GenerateResponse]:
    """The messages one engine output of choice `index` turns into (`eos_token_id`: see
    complete_to_proto). Prompt logprobs, as vLLM's servicer sends them: streaming, on the
    first chunk (and on the complete of an output that carries them); not, on the complete."""
    k = inp.num_prompt_logprobs or 0
    if inp.stream:
        msgs = [chunk_to_proto(out, index, inp.num_logprobs, prompt_ids, k)
                ] if out.new_token_ids else []
        if out.finished:
            msgs.append(complete_to_proto(out, index, inp.num_logprobs, out.new_token_ids,
                                          out.logprobs, eos_token_id,
                                          _input_logprobs(out.prompt_logprobs, prompt_ids, k)))
        return msgs
    choice.token_ids.extend(out.new_token_ids)
    choice.logprobs.extend(out.logprobs)
    choice.prompt_logprobs = choice.prompt_logprobs or out.prompt_logprobs
    if not out.finished:
        return []
    return [complete_to_proto(out, index, inp.num_logprobs, choice.token_ids, choice.logprobs,
                              eos_token_id, _input_logprobs(choice.prompt_logprobs, prompt_ids,
                                                            k))]


def _builds_off_loop(inp: ValidatedRequest, out: RequestOutput, choice: _Choice) -> bool:
    """Prompt logprobs, the tokens of many steps (a lagging consumer), or a non-streamed
    choice's whole output at its finish (20,000 tokens at 20 logprobs: ~0.15 s of CPU)."""
    return (inp.num_prompt_logprobs is not None or len(out.new_token_ids) > OFF_LOOP_TOKENS
            or (out.finished and not inp.stream and len(choice.token_ids) > OFF_LOOP_TOKENS))


def _input_logprobs(entries, prompt_ids: list[int], k: int):
    return None if not entries else input_logprobs_to_proto(entries, prompt_ids, k)


async def _merge(streams: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output) in arrival order. The first
    failure ends the merge; leaving it early (cancellation) closes every stream, which aborts
    their requests."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:   # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

