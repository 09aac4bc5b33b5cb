"""The public deltaserve.v1.Generation service: short adapters between protobuf and the engine.

Each handler validates and converts its request (convert.py), calls the AsyncEngine, and converts
back. Every failure goes through status.status_for, the one exception -> gRPC status mapping.
A Generate stream is one request: when the client cancels it or its deadline passes, grpc.aio
cancels the handler and AsyncEngine.generate aborts exactly that request, freeing its blocks.

Limits (request_limits.py, ApiOptions) are checked on the protobuf first; text is tokenized, and a
structured-output constraint validated by llguidance, on a thread pool (both release the GIL),
never on the event loop, so one long prompt or big constraint cannot stall the other streams. Abort ends only requests made with the caller's API key (guard.py).
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace
from typing import Callable

import grpc

from engine_common.request.classify import ClassifierInfo
from engine_common.request.params import ParamError
from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import generation_pb2_grpc
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.lora_updates import LoRAUpdates
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.convert import (builds_off_loop, limited_fields, output_to_proto,
                                           request_from_proto, sampling_to_proto)
from scheduler_service.api import scoring
from scheduler_service.api.embeddings import embed_in_place, prompt_of
from scheduler_service.api.front_door import (FrontDoor, ServedModel, abort_requests, abort_with,
                                              ValidatedRequest, messages_from_proto,
                                              new_request_id)
from scheduler_service.api.api_keys import KeyBook, KeyPolicy
from scheduler_service.api.guard import caller_of, policy_of, pool_caller, scoped_id
from scheduler_service.api.request_limits import (check_abort_ids, check_messages_count,
                                                  check_prompt_can_fit, check_tokenize_limits)
from scheduler_service.api.request_quota import TOKENIZE, RequestQuota
from scheduler_service.api.request_tally import RequestTally
from scheduler_service.api.stream_sends import SendWatch, send_watch
from scheduler_service.api.tokenizer_pool import TokenizerPool
from scheduler_service.core.request import Request
from scheduler_service.errors import StalledClient
from scheduler_service.api.status import status_for


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """deltaserve.v1.Generation on top of an AsyncEngine."""

    def __init__(self, engine: AsyncEngine, model: ServedModel,
                 tp_size: Callable[[], int] = lambda: 1, options: ApiOptions = ApiOptions(),
                 tokenizer_pool: TokenizerPool | None = None, keys: KeyBook = KeyBook(),
                 quota: RequestQuota | None = None, lora: LoRAUpdates | None = None,
                 sends: SendWatch | None = None):
        """`tp_size()`: ranks the workers run (known once they are initialized);
        `tokenizer_pool`, `quota` (requests per key), `sends` (--stream-send-timeout): shared
        with the port's other services (ones of its own if None); `keys`: what each API key
        may do (its cache salt, its priorities); `lora`: the runtime LoRA loads
        (docs/lora.md), off when None."""
        self._engine = engine
        self._lora = lora or LoRAUpdates(model.lora, None, allowed=False)
        self._model = model
        self._tp_size = tp_size
        self._options = options
        self._keys = keys
        self._door = FrontDoor(model, options, tokenizer_pool, quota)
        self._owners: dict[str, str] = {}     # live request id -> caller_of() its Generate
        self._sends = sends or send_watch(options, engine)

    # -- Generate ---------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        """Stream one GenerateResponse per engine step that produced tokens for the request.

        Written with context.write (a coroutine handler): each message then passes one async
        generator (the engine's) on its way to grpc, not two more of this layer's. A failed
        write is grpc's to report, as with a generator handler, but for one that waited
        --stream-send-timeout for the client (stream_sends.py: RESOURCE_EXHAUSTED); the
        engine's stream is closed (the request aborted) however the call ends."""
        self._engine.counters.received()
        streamed = writing = False
        owned = None
        caller = caller_of(context)
        try:
            policy = policy_of(context, self._keys)
            req = self._validated(request, policy)
            # The place first: a key at its bound is refused before it costs tokenizer time.
            with self._door.quota.hold(caller, req.request_id):
                engine_request = await self._to_engine_request(req, policy,
                                                               pool_caller(context), caller)
                owned = self._own(engine_request.request_id, caller)
                async with aclosing(self._engine.generate(engine_request)) as outputs:
                    async for out in outputs:
                        first, streamed = not streamed, True
                        args = (out, self._token_text, req.request_id,
                                engine_request.prompt_token_ids)
                        # Prompt logprobs take seconds for a long prompt (a lagging
                        # consumer's pile, too): built off the event loop, so that the other
                        # streams keep flowing meanwhile.
                        msg = (await asyncio.to_thread(output_to_proto, *args)
                               if builds_off_loop(out) else output_to_proto(*args))
                        writing = True
                        await self._sends.write(context, msg, first)   # StalledClient past it
                        writing = False
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every failure becomes one status, through one function
            if writing and not isinstance(e, StalledClient):   # grpc's error: the call is over
                raise
            self._count_failure(e, streamed)
            await abort_with(context, e)
        finally:
            if owned is not None:
                self._owners.pop(owned, None)

    def _count_failure(self, error: Exception, streamed: bool) -> None:
        """Before the first output a failure is a rejection (by status code); after it, a
        request that finished with an error. Not a stream cut by --stream-send-timeout: the
        engine counts its request's end (abort, or how it finished before the cut)."""
        if isinstance(error, StalledClient):
            return
        if streamed:
            self._engine.counters.failed_after_output()
        else:
            self._engine.counters.rejected(status_for(error)[0].name)

    def _own(self, request_id: str, caller: str) -> str | None:
        """Record who may abort `request_id` (not a duplicate's caller: admission refuses it)."""
        if request_id in self._owners:
            return None
        self._owners[request_id] = caller
        return request_id

    def _validated(self, msg: pb.GenerateRequest, policy: KeyPolicy) -> ValidatedRequest:
        """Every field checked, nothing costly done yet (no tokenizing)."""
        info = self._model.info
        self._model.check_runner("Generate")
        self._door.check_limits(msg, limited_fields(msg))
        policy.check_priority(msg.priority)
        return request_from_proto(msg, defaults=self._model.default_sampling,
                                  vocab_size=info.vocab_size,
                                  max_logprobs=self._options.max_logprobs)

    async def _to_engine_request(self, req: ValidatedRequest, policy: KeyPolicy,
                                 pool_share: str, caller: str) -> Request:
        """The engine's request (its id scoped to the caller's key); the prompt tokenized in
        `pool_share`'s share of the tokenizer threads."""
        ids = await self._door.prompt_ids(req, pool_share)
        return self._door.engine_request(req, scoped_id(caller, req.request_id), ids,
                                         policy.salt)

    def _token_text(self, token_id: int) -> str:
        return self._model.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- unary RPCs -------------------------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        """Abort the caller's live requests by id; unknown ids, and ids of requests made with
        another API key, are ignored; more ids than MAX_ABORT_IDS: INVALID_ARGUMENT."""
        try:
            check_abort_ids(request.request_ids)
        except ParamError as e:
            await abort_with(context, e)
        caller = caller_of(context)
        scoped = (scoped_id(caller, rid) for rid in request.request_ids)
        ids = [rid for rid in scoped if self._owners.get(rid) == caller]
        return pb.AbortResponse(num_aborted=await abort_requests(self._engine, ids, context))

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        """One prompt's vector on a --runner pooling server (embeddings.py); counted in the
        request counters as a Generate is."""
        self._engine.counters.received()
        caller = caller_of(context)
        try:
            self._model.check_runner("Embed")
            if request.HasField("text") and request.token_ids:
                raise ParamError("prompt", "text and token_ids", "exactly one of them")
            rid = request.request_id or new_request_id()
            with self._door.quota.hold(caller, rid):       # before tokenizing
                ids = await prompt_of(self._door, request.token_ids, request.text,
                                      pool_caller(context), ("prompt", "token_ids", "text"))
                vector = await embed_in_place(self._engine, self._door, caller, rid, ids,
                                              policy_of(context, self._keys))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes one status
            self._count_failure(e, False)
            await abort_with(context, e)
        return pb.EmbedResponse(request_id=rid, embedding=vector, num_prompt_tokens=len(ids))

    async def Classify(self, request: pb.ClassifyRequest, context) -> pb.ClassifyResponse:
        """Each text's class on a classification model's pooling server (scoring.py); each
        text counted in the request counters as an Embed is."""
        rid = request.request_id or new_request_id()
        tally = RequestTally(self._engine.counters)
        try:
            out = await scoring.classify(
                self._engine, self._door, caller_of(context), rid, list(request.input),
                _activation(request), policy_of(context, self._keys),
                pool_caller(context), tally)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes one status
            tally.failed(e)
            await abort_with(context, e)
        data = [pb.ClassifyResult(index=i, label=c.label, probs=c.probs,
                                  num_classes=len(c.probs)) for i, c in enumerate(out)]
        return pb.ClassifyResponse(request_id=rid, data=data,
                                   num_prompt_tokens=sum(c.num_tokens for c in out))

    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        """Cross-encoder scores of the pairs (1-to-N or N-to-N; scoring.py); each pair
        counted in the request counters as an Embed is."""
        rid = request.request_id or new_request_id()
        tally = RequestTally(self._engine.counters)
        try:
            scores, num_tokens = await scoring.score(
                self._engine, self._door, caller_of(context), rid, list(request.text_1),
                list(request.text_2), _activation(request),
                policy_of(context, self._keys), pool_caller(context), tally)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes one status
            tally.failed(e)
            await abort_with(context, e)
        return pb.ScoreResponse(request_id=rid, num_prompt_tokens=num_tokens, data=[
            pb.ScoreResult(index=i, score=v) for i, v in enumerate(scores)])

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        """Token ids of the text or chat, exactly as a Generate prompt is tokenized."""
        try:
            if request.messages and request.text:
                raise ParamError("prompt", "text and messages", "exactly one of text or messages")
            check_messages_count(request.messages, self._model.info.max_model_len)
            check_tokenize_limits(request, self._options)
            check_prompt_can_fit(request, self._model.prompt_chars_fit,
                                 self._model.info.max_model_len)
            caller = pool_caller(context)
            with self._door.quota.call(caller_of(context), "", TOKENIZE):
                if request.messages:
                    ids = await self._door.offload(caller, self._model.chat_prompt_ids,
                                                   messages_from_proto(request.messages))
                else:
                    ids = await self._door.offload(caller, self._model.tokenizer.encode,
                                                   request.text)
        except Exception as e:
            await abort_with(context, e)
        return pb.TokenizeResponse(token_ids=ids, num_tokens=len(ids))

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        """The model, the engine's limits and the sampling defaults."""
        m = self._model
        return pb.GetModelInfoResponse(
            model_name=m.info.name, max_model_len=m.info.max_model_len,
            vocab_size=m.info.vocab_size, eos_token_ids=m.info.eos_token_ids,
            tp_size=self._tp_size(), num_kv_blocks=self._engine.stats.num_total_blocks,
            kv_block_size=m.block_size,
            # This API's unset temperature is greedy (generation.proto), whatever the model's.
            default_sampling=sampling_to_proto(replace(m.default_sampling, temperature=0.0)),
            max_logprobs=self._options.max_logprobs,
            has_chat_template=m.chat_template is not None,
            runner="generate" if m.pooler is None else "pooling",
            pooling_type="" if m.pooler is None else m.pooler.pooling_type,
            pooling_normalize=m.pooler is not None and m.pooler.normalize,
            **_labels(m))

    # -- LoRA adapters at run time (docs/lora.md; admin keys only: api_keys.ADMIN_METHODS) -----

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,
                              context) -> pb.LoadLoraAdapterResponse:
        """Load an adapter on every worker rank; OK once requests may name it."""
        name, path = request.lora_name, request.lora_path
        adapter = await self._on_engine(context, "LoadLoraAdapter", lambda core, drain: self._lora
                                        .load(core.scheduler.lora_ids_in_use(), drain, name,
                                              path, core.scheduler.lora_ids_running))
        return pb.LoadLoraAdapterResponse(lora_id=adapter.lora_id)

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,
                                context) -> pb.UnloadLoraAdapterResponse:
        """Stop serving an adapter: new requests naming it get NOT_FOUND."""
        name = request.lora_name
        await self._on_engine(context, "UnloadLoraAdapter", lambda core, drain: self._lora
                              .unload(core.scheduler.lora_ids_in_use(), drain, name))
        return pb.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(self, request, context) -> pb.ListLoraAdaptersResponse:
        """The adapters requests may name now."""
        return pb.ListLoraAdaptersResponse(adapters=[
            pb.LoraAdapter(lora_name=a.name, lora_path=a.path, lora_id=a.lora_id,
                           static=a.static) for a in self._model.lora.adapters()])

    async def _on_engine(self, context, call: str, fn):
        """fn(core, drain) on the engine thread; its error as a status (status_for)."""
        try:
            self._lora.check_allowed(call)     # refused before the engine is asked
            return await asyncio.wrap_future(self._engine.call_on_engine(fn))
        except Exception as e:  # every failure becomes one status, through one function
            await abort_with(context, e)

    async def GetServerStatus(self, request, context) -> pb.GetServerStatusResponse:
        """Live load figures from the engine thread's latest snapshot."""
        stats = self._engine.stats
        prompt_tps, gen_tps = self._engine.throughput()
        return pb.GetServerStatusResponse(
            num_waiting=stats.num_waiting, num_running=stats.num_running,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            generation_tokens_per_s=gen_tps, prompt_tokens_per_s=prompt_tps,
            num_workers_ready=stats.num_workers_ready(self._model.num_workers),
            num_workers=self._model.num_workers,
            num_used_kv_blocks=stats.num_used_blocks, num_kv_blocks=stats.num_total_blocks,
            num_used_window_kv_blocks=stats.num_used_window_blocks,
            num_window_kv_blocks=stats.num_total_window_blocks,
            max_steps_in_flight=stats.max_steps_in_flight,
            num_steps_in_flight=stats.num_steps_in_flight)



def _activation(request) -> bool:
    """A Classify / Score request's `activation` (unset: true)."""
    return not request.HasField("activation") or request.activation


def _labels(m: ServedModel) -> dict:
    """GetModelInfo's num_labels and labels for a classification model, else nothing."""
    if m.pooler is None or not m.pooler.classify:
        return {}
    info = ClassifierInfo.from_config(m.info.hf_config)
    return {"num_labels": info.num_labels, "labels": info.labels}
