"""vllm.grpc.engine protobuf <-> domain: what each request field becomes, every field we cannot
honour refused by name, responses shaped as vLLM's servicer shapes them, KV events as the proto
defines them."""
from __future__ import annotations

import json

import pytest

from engine_common.constraints.constraint import Constraint
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import ParamError, SamplingParams
from engine_common.wire.protos import smg_common_pb2 as cpb
from engine_common.wire.protos import vllm_engine_pb2 as pb
from scheduler_service.api import vllm_convert as vc
from scheduler_service.api.front_door import (ValidatedRequest, check_prompt_length,
                                              checked_constraint, constraint_named)
from scheduler_service.core.block_hashes import hash_block
from scheduler_service.core.kv_events import (FULL_GROUP, AllBlocksCleared, BlockNamespace,
                                              BlockRemoved, BlockStored, KvGroupTag)
from scheduler_service.core.request import RequestStatus
from scheduler_service.engine.engine_stats import EngineStats
from scheduler_service.engine.kv_event_publisher import KvEventBatch
from scheduler_service.engine.output_processor import RequestOutput, RequestTimings, TokenLogprob


def gen(**fields) -> pb.GenerateRequest:
    fields.setdefault("tokenized", pb.TokenizedInput(input_ids=[5, 6, 7]))
    return pb.GenerateRequest(request_id="r1", **fields)


def convert(msg: pb.GenerateRequest, **kw) -> ValidatedRequest:
    return vc.request_from_proto(msg, vocab_size=100, **kw)


# -- requests ---------------------------------------------------------------------------------

def test_tokenized_request_with_every_supported_field():
    sp = pb.SamplingParams(temperature=0.5, top_p=0.75, top_k=40, min_p=0.125,
                           frequency_penalty=0.25, presence_penalty=-0.5, repetition_penalty=1.5,
                           max_tokens=9, min_tokens=2, stop=["\n\n"], stop_token_ids=[7],
                           ignore_eos=True, include_stop_str_in_output=True, logprobs=3, seed=11,
                           skip_special_tokens=True)
    inp = convert(gen(sampling_params=sp, stream=True))
    assert (inp.request_id, inp.prompt_token_ids, inp.prompt_text) == ("r1", (5, 6, 7), None)
    assert inp.sampling == SamplingParams(temperature=0.5, top_p=0.75, top_k=40, min_p=0.125,
                                          repetition_penalty=1.5, presence_penalty=-0.5,
                                          frequency_penalty=0.25, seed=11)
    s = inp.stopping
    assert (s.max_tokens, s.min_tokens, s.stop, s.stop_token_ids) == (9, 2, ("\n\n",), (7,))
    assert s.ignore_eos and s.include_stop_str_in_output
    assert (inp.num_logprobs, inp.n, inp.stream) == (3, 1, True)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_is_taken_as_sent(skip):
    sp = pb.SamplingParams(stop=["</s>"], skip_special_tokens=skip)
    assert convert(gen(sampling_params=sp)).stopping.skip_special_tokens is skip


def test_unset_and_zero_fields_take_the_server_defaults():
    defaults = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05,
                              repetition_penalty=1.1, seed=3)
    inp = convert(gen(), defaults=defaults)
    assert inp.sampling == defaults
    assert inp.stopping.max_tokens is None          # until max_model_len
    assert inp.num_logprobs is None and inp.n == 1 and not inp.stream
    assert convert(gen()).sampling == SamplingParams()    # ours: greedy
    explicit = convert(gen(sampling_params=pb.SamplingParams(temperature=0.0)), defaults=defaults)
    assert explicit.sampling.temperature == 0.0


def test_text_prompt_and_request_id_assignment():
    inp = vc.request_from_proto(pb.GenerateRequest(text="hello"), make_request_id=lambda: "new")
    assert (inp.request_id, inp.prompt_text, inp.prompt_token_ids) == ("new", "hello", None)


def test_negative_seed_maps_onto_the_unsigned_range():
    assert convert(gen(sampling_params=pb.SamplingParams(seed=-1))).sampling.seed == 2**32 - 1
    assert convert(gen(sampling_params=pb.SamplingParams(seed=0))).sampling.seed == 0


@pytest.mark.parametrize("msg,field", [
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(text=""), "text"),
    (pb.GenerateRequest(tokenized=pb.TokenizedInput()), "tokenized.input_ids"),
    (gen(tokenized=pb.TokenizedInput(input_ids=[1, 100])), "tokenized.input_ids[1]"),
    (gen(sampling_params=pb.SamplingParams(stop_token_ids=[100])),
     "sampling_params.stop_token_ids[0]"),
    (gen(sampling_params=pb.SamplingParams(top_p=1.5)), "sampling_params.top_p"),
    (gen(sampling_params=pb.SamplingParams(temperature=-1)), "sampling_params.temperature"),
    (gen(sampling_params=pb.SamplingParams(max_tokens=0)), "sampling_params.max_tokens"),
    (gen(sampling_params=pb.SamplingParams(max_tokens=2, min_tokens=3)),
     "sampling_params.min_tokens"),
    (gen(sampling_params=pb.SamplingParams(logprobs=-1)), "sampling_params.logprobs"),
    (gen(sampling_params=pb.SamplingParams(logprobs=21)), "sampling_params.logprobs"),
    (gen(sampling_params=pb.SamplingParams(n=vc.MAX_N + 1)), "sampling_params.n"),
    (gen(sampling_params=pb.SamplingParams(logit_bias={100: 1.0})),
     "sampling_params.logit_bias[100]"),
    (gen(sampling_params=pb.SamplingParams(logit_bias={5: 101.0})),
     "sampling_params.logit_bias[5]"),
    (gen(sampling_params=pb.SamplingParams(logit_bias={-1: 1.0})),
     "sampling_params.logit_bias[-1] (token id)"),
])
def test_bad_fields_are_named(msg, field):
    with pytest.raises(ParamError) as err:
        convert(msg)
    assert err.value.field == field


UNSUPPORTED = [
    (gen(sampling_params=pb.SamplingParams(structural_tag="{}")),
     "sampling_params.structural_tag"),
    (gen(sampling_params=pb.SamplingParams(prompt_logprobs=-1)),
     "sampling_params.prompt_logprobs"),
    (gen(sampling_params=pb.SamplingParams(truncate_prompt_tokens=-1)),
     "sampling_params.truncate_prompt_tokens"),
    (gen(kv_transfer_params=pb.KvTransferParams(remote_host="h")), "kv_transfer_params"),
    (gen(kv_transfer_params_json="{}"), "kv_transfer_params_json"),
    (gen(mm_inputs=pb.MultimodalInputs()), "mm_inputs"),
    (gen(extra_mm_inputs=[pb.MultimodalInputs()]), "extra_mm_inputs"),
    (gen(media_refs=pb.MediaRefs()), "media_refs"),
    (gen(data_parallel_rank=1), "data_parallel_rank"),
]


@pytest.mark.parametrize("msg,field", UNSUPPORTED)
def test_fields_we_cannot_honour_are_refused_by_name(msg, field):
    with pytest.raises(ParamError) as err:
        convert(msg)
    assert err.value.field == field
    assert "not supported" in err.value.allowed or "one data-parallel rank" in err.value.allowed


SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.mark.parametrize("sp,expected", [
    (pb.SamplingParams(json_schema=SCHEMA), Constraint("json_schema", SCHEMA)),
    (pb.SamplingParams(regex="[0-9]{3}"), Constraint("regex", "[0-9]{3}")),
    (pb.SamplingParams(grammar='root ::= "a" [bc]*'), Constraint("grammar", 'root ::= "a" [bc]*')),
    (pb.SamplingParams(json_object=True), Constraint("json_object", True)),
    (pb.SamplingParams(choice=pb.ChoiceConstraint(choices=["yes", "no"])),
     Constraint("choice", ("yes", "no"))),
    (pb.SamplingParams(regex="a+", grammar_from_first_token=True), Constraint("regex", "a+")),
    (pb.SamplingParams(max_tokens=3), None),
])
def test_the_constraint_oneof_maps_onto_our_constraint(sp, expected):
    assert convert(gen(sampling_params=sp)).constraint == expected


@pytest.mark.parametrize("sp,field,says", [
    (pb.SamplingParams(regex="([0-9]"), "sampling_params.regex", "unclosed group"),
    (pb.SamplingParams(json_schema="{not json"), "sampling_params.json_schema", "JSON"),
    (pb.SamplingParams(json_schema='{"type": "object", "uniqueItems": true}'),
     "sampling_params.json_schema", "uniqueItems"),
    (pb.SamplingParams(grammar="root ::= undefined_rule"), "sampling_params.grammar",
     "undefined_rule"),
    (pb.SamplingParams(choice=pb.ChoiceConstraint(choices=[])), "sampling_params.choice.choices",
     "one or more"),
    (pb.SamplingParams(json_object=False, regex=""), "sampling_params.regex", "non-empty"),
])
def test_a_bad_constraint_names_its_field_with_the_engines_message(sp, field, says):
    with pytest.raises(ParamError) as err:
        with constraint_named(vc.NAMES.constraint):
            checked_constraint(convert(gen(sampling_params=sp)).constraint)
    assert err.value.field == field
    assert says in err.value.allowed or says in str(err.value)


def test_structural_tag_is_refused_naming_what_is_supported():
    with pytest.raises(ParamError) as err:
        convert(gen(sampling_params=pb.SamplingParams(structural_tag='{"format": {}}')))
    assert err.value.field == "sampling_params.structural_tag"
    for kind in ("json_schema", "regex", "grammar", "json_object", "choice"):
        assert kind in err.value.allowed


def test_data_parallel_rank_zero_is_this_replica():
    assert convert(gen(data_parallel_rank=0)).request_id == "r1"


def test_prompt_length_names_this_protocols_field():
    check_prompt_length(10, 5, 16)
    with pytest.raises(ParamError) as err:
        check_prompt_length(10, 7, 16, vc.NAMES.stopping)
    assert err.value.field == "sampling_params.max_tokens"
    with pytest.raises(ParamError) as err:
        check_prompt_length(16, None, 16)
    assert err.value.field == "prompt"


def test_child_seeds_differ_and_stay_reproducible():
    seeded = SamplingParams(temperature=1.0, seed=2**63 - 1)
    assert [vc.child_sampling(seeded, i).seed for i in range(3)] == [2**63 - 1, 0, 1]
    unseeded = SamplingParams(temperature=1.0)
    assert vc.child_sampling(unseeded, 2) is unseeded


# -- responses --------------------------------------------------------------------------------

def output(new, finished=False, reason=None, stop=None, logprobs=()) -> RequestOutput:
    return RequestOutput("r1", list(new), "", list(logprobs), finished, reason, stop,
                         num_prompt_tokens=3, num_output_tokens=len(new), num_cached_tokens=2,
                         timings=RequestTimings(0.0, None, None))


LP = [TokenLogprob(7, -0.5, [7, 9], [-0.5, -1.5]), TokenLogprob(8, -0.25, [8, 1], [-0.25, -2.0])]


def test_chunk_carries_the_step_and_its_own_count():
    msg = vc.chunk_to_proto(output([7, 8], logprobs=LP), 2, num_logprobs=2).chunk
    assert (list(msg.token_ids), msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens,
            msg.index) == ([7, 8], 3, 2, 2, 2)
    lp = msg.output_logprobs
    assert list(lp.token_ids) == [7, 8] and list(lp.token_logprobs) == [-0.5, -0.25]
    assert [list(t.token_ids) for t in lp.top_logprobs] == [[7, 9], [8, 1]]
    assert [list(t.values) for t in lp.top_logprobs] == [[-0.5, -1.5], [-0.25, -2.0]]
    plain = vc.chunk_to_proto(output([7, 8], logprobs=LP), 0, num_logprobs=0).chunk
    assert list(plain.output_logprobs.token_ids) == [7, 8] and not plain.output_logprobs.top_logprobs
    assert not vc.chunk_to_proto(output([7], logprobs=LP[:1]), 0, None).chunk.HasField(
        "output_logprobs")


@pytest.mark.parametrize("reason,stop,expected,which", [
    (RequestStatus.FINISHED_LENGTH, None, "length", None),
    (RequestStatus.FINISHED_STOP_TOKEN, 2, "stop", "matched_token_id"),
    (RequestStatus.FINISHED_STOP_STRING, "\n", "stop", "matched_stop_str"),
    (RequestStatus.FINISHED_ABORTED, None, "abort", None),
])
def test_complete_finish_reason_and_matched_stop(reason, stop, expected, which):
    final = output([9], finished=True, reason=reason, stop=stop)
    msg = vc.complete_to_proto(final, 1, None, [4, 5, 9], []).complete
    assert (msg.finish_reason, list(msg.output_ids), msg.completion_tokens, msg.index) == (
        expected, [4, 5, 9], 3, 1)
    assert msg.WhichOneof("matched_stop") == which
    if which:
        assert getattr(msg, which) == stop


def test_default_sampling_json_and_model_info():
    defaults = SamplingParams(temperature=0.6, top_p=0.9)
    assert json.loads(vc.default_sampling_json(defaults)) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    info = ModelInfo(path="/m/Smol", name="Smol", architecture="LlamaForCausalLM",
                     vocab_size=100, max_model_len=64, eos_token_ids=(2, 3),
                     hf_config={"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                "pad_token_id": 2})
    msg = vc.model_info_to_proto(info, 1, defaults)
    assert (msg.model_path, msg.served_model_name, msg.tokenizer_path, msg.model_type) == (
        "/m/Smol", "Smol", "/m/Smol", "llama")
    assert (msg.max_context_length, msg.max_req_input_len, msg.vocab_size) == (64, 63, 100)
    assert list(msg.eos_token_ids) == [2, 3] and (msg.pad_token_id, msg.bos_token_id) == (2, 1)
    assert list(msg.architectures) == ["LlamaForCausalLM"] and msg.is_generation
    assert json.loads(msg.default_sampling_params_json)["temperature"] == 0.6


def test_server_info_and_loads():
    shape = vc.EngineShape(block_size=16, max_num_seqs=8, dtype="float32",
                           attention_backend="auto")
    info = vc.server_info_to_proto(3, 12.5, 99.0, shape)
    assert (info.active_requests, info.uptime_seconds, info.last_receive_timestamp) == (3, 12.5,
                                                                                        99.0)
    assert (info.block_size, info.max_num_seqs, info.model_dtype, info.attention_backend,
            info.data_parallel_size, info.kv_cache_dtype) == (16, 8, "float32", "", 1, "auto")
    fp8 = vc.EngineShape(16, 8, "bfloat16", "cpu", kv_cache_dtype="fp8")
    assert vc.server_info_to_proto(0, 0.0, 0.0, fp8).kv_cache_dtype == "fp8"
    stats = EngineStats(ready=True, num_waiting=1, num_running=2, num_used_blocks=5,
                        num_total_blocks=20, prefix_cache_hit_rate=0.5)
    load = vc.scheduler_load_to_proto(stats, 42.0, shape)
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (2, 1, 3)
    assert (load.num_used_tokens, load.max_total_num_tokens, load.token_usage) == (80, 320, 0.25)
    assert (load.gen_throughput, load.cache_hit_rate, load.utilization,
            load.max_running_requests) == (42.0, 0.5, 0.25, 8)


# -- KV events --------------------------------------------------------------------------------

def test_block_hash_to_int64_is_signed_and_stable():
    assert vc.block_hash_to_int64(b"\x01" + b"\x00" * 15) == 1
    assert vc.block_hash_to_int64(b"\xff" * 8 + b"\x00" * 8) == -1
    assert vc.block_hash_to_int64(bytes(range(16))) == int.from_bytes(bytes(range(8)), "little")


def test_kv_batch_to_proto():
    h0 = hash_block(None, [1, 2])
    h1 = hash_block(h0, [3, 4])
    batch = KvEventBatch(7, 1.5, (AllBlocksCleared(),
                                  BlockStored([h0, h1], None, [1, 2, 3, 4], 2),
                                  BlockStored([hash_block(h1, [5, 6])], h1, [5, 6], 2),
                                  BlockRemoved([h0, h1])), first_event_id=40)
    msg = vc.kv_batch_to_proto(batch)
    assert (msg.sequence_number, msg.timestamp) == (7, 1.5)
    assert [e.event_id for e in msg.events] == [40, 41, 42, 43]
    assert [e.WhichOneof("data") for e in msg.events] == ["cleared", "stored", "stored", "removed"]
    first = msg.events[1].stored
    assert not first.HasField("parent_block_hash")
    assert [(b.block_hash, list(b.token_ids), b.block_size) for b in first.blocks] == [
        (vc.block_hash_to_int64(h0), [1, 2], 2), (vc.block_hash_to_int64(h1), [3, 4], 2)]
    assert msg.events[2].stored.parent_block_hash == vc.block_hash_to_int64(h1)
    assert list(msg.events[3].removed.block_hashes) == [vc.block_hash_to_int64(h0),
                                                        vc.block_hash_to_int64(h1)]
    assert cpb.KvEventBatch.FromString(msg.SerializeToString()) == msg
    for block in first.blocks:                 # the base model, no salt: nothing more is sent
        assert not block.HasField("lora_id") and not block.extra_keys
    assert not first.HasField("lora_name") and not first.HasField("cache_salt")


def test_stored_blocks_carry_their_namespace_as_vllm_publishes_it():
    """vLLM's BlockStored: lora_id (per load) and lora_name, the salt; per block extra_keys
    hold the adapter's name, and the salt on a prompt's first block only."""
    h0 = hash_block(None, [1, 2])
    ns = BlockNamespace(lora_id=5, lora_name="sql", cache_salt="ab" * 16)
    batch = KvEventBatch(1, 0.0, (BlockStored([h0, hash_block(h0, [3, 4])], None, [1, 2, 3, 4],
                                              2, ns),
                                  BlockStored([hash_block(h0, [9, 9])], h0, [9, 9], 2, ns)))
    first, later = (e.stored for e in vc.kv_batch_to_proto(batch).events)
    assert (first.lora_name, first.cache_salt) == ("sql", "ab" * 16)
    assert [b.lora_id for b in first.blocks] == [5, 5]
    keys = [[k.text for k in b.extra_keys] for b in [*first.blocks, *later.blocks]]
    assert keys == [["sql", "ab" * 16], ["sql"], ["sql"]]


def test_a_hybrid_models_events_name_their_group_as_vllm_publishes_them():
    """group_idx, kv_cache_spec_kind and (the window group's) kv_cache_spec_sliding_window on
    stored blocks, group_idx on removed ones; untagged events leave every field unset."""
    h0 = hash_block(None, [1, 2])
    window = KvGroupTag(1, "sliding_window", 8)
    batch = KvEventBatch(1, 0.0, (BlockStored([h0], None, [1, 2], 2, group=FULL_GROUP),
                                  BlockStored([h0], None, [1, 2], 2, group=window),
                                  BlockRemoved([h0], window), BlockRemoved([h0], FULL_GROUP),
                                  BlockStored([h0], None, [1, 2], 2), BlockRemoved([h0])))
    events = vc.kv_batch_to_proto(batch).events
    full, win = events[0].stored, events[1].stored
    assert (full.group_idx, full.kv_cache_spec_kind) == (0, "full_attention")
    assert not full.HasField("kv_cache_spec_sliding_window")
    assert (win.group_idx, win.kv_cache_spec_kind, win.kv_cache_spec_sliding_window) == (
        1, "sliding_window", 8)
    assert [events[i].removed.group_idx for i in (2, 3)] == [1, 0]
    assert events[3].removed.HasField("group_idx")
    plain_stored, plain_removed = events[4].stored, events[5].removed
    assert not any(plain_stored.HasField(f) for f in ("group_idx", "kv_cache_spec_kind",
                                                      "kv_cache_spec_sliding_window"))
    assert not plain_removed.HasField("group_idx")


def test_logit_bias_is_carried_sorted_by_token_id():
    inp = convert(gen(sampling_params=pb.SamplingParams(logit_bias={9: -100.0, 5: 1.5})))
    assert inp.sampling.logit_bias == ((5, 1.5), (9, -100.0))


def test_allowed_token_ids_are_carried_and_an_id_outside_the_vocabulary_is_refused_by_name():
    inp = convert(gen(sampling_params=pb.SamplingParams(allowed_token_ids=[9, 5])))
    assert inp.sampling.allowed_token_ids == (5, 9)
    with pytest.raises(ParamError) as err:
        convert(gen(sampling_params=pb.SamplingParams(allowed_token_ids=[100])))
    assert str(err.value) == ("sampling_params.allowed_token_ids[0]=100 is invalid: must be in "
                              "[0, 99] (vocab_size)")
