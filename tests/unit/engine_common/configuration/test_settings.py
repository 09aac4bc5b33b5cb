"""Settings declared once: rules, flags, the protobuf message and the wire forms all come from the
field declarations."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from engine_common.configuration.config import (SchedulerConfig, WorkerConfig, WorkerServiceOptions,
                                  limits_of)
from engine_common.request.diff_limits import MAX_WAITING
from engine_common.request.params import ParamError
from engine_common.wire.protos import worker_pb2
from engine_common.configuration.settings import (AtLeast, add_flags, declared, from_args, from_proto,
                                    proto_message, setting, to_flags, to_proto, validate)


def _parse(*argv, classes=(SchedulerConfig, WorkerConfig)):
    parser = argparse.ArgumentParser()
    add_flags(parser, *classes)
    return parser, parser.parse_args(list(argv))


@pytest.mark.parametrize("field,value,allowed", [
    ("max_num_seqs", 0, "an integer in [1, 65536]"),
    ("block_size", 24, "a power of two in [1, 1024]"),
    ("block_size", True, "a power of two in [1, 1024]"),
    ("dtype", "fp8", "one of auto, bfloat16, float16, float32"),
    ("gpu_memory_utilization", 1.5, "in (0, 1.0]"),
    ("fused_ops", 1, "a bool"),
    ("cpu_quantized_weights", "Native", "one of native, dequantize"),
])
def test_a_bad_value_names_the_field_the_value_and_the_range(field, value, allowed):
    with pytest.raises(ParamError) as e:
        WorkerConfig(model_dir="/m", **{field: value})
    assert (e.value.field, e.value.value, e.value.allowed) == (field, value, allowed)


def test_max_waiting_stops_at_the_ceiling_the_workers_cache_bound_allows():
    """The workers bound their cached requests by max_num_seqs + MAX_WAITING
    (diff_limits.max_cached_requests): a longer queue could make a legal scheduler trip it."""
    assert SchedulerConfig(max_waiting=MAX_WAITING).max_waiting == MAX_WAITING
    with pytest.raises(ParamError, match=rf"max_waiting={MAX_WAITING + 1} is invalid: must be an "
                                         rf"integer in \[1, {MAX_WAITING}\]"):
        SchedulerConfig(max_waiting=MAX_WAITING + 1)


def test_cross_field_rules_are_checked_once_in_the_shared_base():
    for cls in (SchedulerConfig, WorkerConfig):
        with pytest.raises(ParamError, match="max_num_batched_tokens=8 is invalid: must be >= "
                                             r"max_num_seqs \(16\)"):
            cls(model_dir="/m", max_num_seqs=16, max_num_batched_tokens=8) \
                if cls is WorkerConfig else cls(max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ParamError, match="gpu_memory_utilization"):
        WorkerConfig(model_dir="/m", kv_cache_bytes=1, gpu_memory_utilization=0.5)
    with pytest.raises(ParamError, match="node_rank=2 is invalid"):
        WorkerServiceOptions(node_rank=2, nodes=2)


def test_flags_come_from_the_declarations_shared_fields_once():
    parser, args = _parse("--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                          "--no-prefix-caching", "--kv-cache-gib", "0.5", "--fused-ops")
    worker = from_args(WorkerConfig, args, model_dir="/m")
    policy = from_args(SchedulerConfig, args)
    assert (worker.max_num_seqs, policy.max_num_seqs) == (8, 8)
    assert worker.kv_cache_bytes == 1 << 29 and worker.fused_ops
    assert policy.enable_prefix_caching is False and limits_of(policy) == limits_of(worker)
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings]
    assert flags.count("--max-num-seqs") == 1 and "--model-dir" not in flags
    help_text = parser.format_help()
    assert "requests in the running batch (default: 256)" in help_text
    assert "--no-prefix-caching" in help_text and "--kv-cache-gib GIB" in help_text


def test_unset_flags_leave_the_declared_defaults():
    _, args = _parse()
    assert from_args(WorkerConfig, args, model_dir="/m") == WorkerConfig(model_dir="/m")
    assert from_args(SchedulerConfig, args) == SchedulerConfig()


def test_a_bad_flag_value_is_the_same_param_error():
    _, args = _parse("--block-size", "12")
    with pytest.raises(ParamError, match="block_size=12 is invalid: must be a power of two"):
        from_args(WorkerConfig, args, model_dir="/m")


def test_to_flags_rebuilds_the_same_options():
    options = WorkerServiceOptions(device="cpu", local_ranks=2, rank_step_timeout_s=12.5)
    _, args = _parse(*to_flags(options), classes=(WorkerServiceOptions,))
    assert from_args(WorkerServiceOptions, args) == options


def test_proto_round_trip_keeps_values_and_unset_means_default():
    config = WorkerConfig(model_dir="/m", dtype="float32", kv_cache_bytes=1 << 20,
                          max_num_seqs=4, max_num_batched_tokens=64, verify_symmetry=True)
    message = worker_pb2.WorkerConfig()
    to_proto(config, message)
    assert not message.HasField("gpu_memory_utilization") and not message.HasField(
        "max_model_len")
    back = from_proto(WorkerConfig, worker_pb2.WorkerConfig.FromString(message.SerializeToString()))
    assert back == config
    assert from_proto(WorkerConfig, worker_pb2.WorkerConfig(model_dir="/x")) == WorkerConfig(
        model_dir="/x")


def test_a_refused_wire_value_is_a_param_error():
    with pytest.raises(ParamError, match="block_size=3"):
        from_proto(WorkerConfig, worker_pb2.WorkerConfig(model_dir="/m", block_size=3))


def test_every_wire_field_of_worker_config_is_in_the_proto():
    proto_fields = {f.name: f.number for f in worker_pb2.WorkerConfig.DESCRIPTOR.fields}
    wire = {d.name: d.setting.wire for d in declared(WorkerConfig)}
    assert proto_fields == wire


def test_a_new_declaration_is_a_flag_a_proto_field_and_a_checked_value():
    """What adding a worker setting takes: one declaration (then `make proto`)."""

    @dataclass(frozen=True)
    class Extended(WorkerConfig):
        prefill_chunk: int = setting(512, "tokens of one prefill chunk", rule=AtLeast(16),
                                     wire=40)

    _, args = _parse("--prefill-chunk", "64", classes=(Extended,))
    assert from_args(Extended, args, model_dir="/m").prefill_chunk == 64
    assert "  // Tokens of one prefill chunk.\n  optional int64 prefill_chunk = 40;" in \
        proto_message(Extended, "Extended")
    with pytest.raises(ParamError, match="prefill_chunk=8 is invalid: must be an integer in "
                                         r"\[16, inf\]"):
        Extended(model_dir="/m", prefill_chunk=8)
    validate(Extended(model_dir="/m"))


def test_an_alias_sets_the_same_field():
    """vLLM's --tensor-parallel-size (and -tp) is --local-ranks on one node."""
    from engine_common.configuration.config import WorkerServiceOptions

    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerServiceOptions)
    for argv in (["--tensor-parallel-size", "2"], ["-tp", "2"], ["--local-ranks", "2"]):
        assert from_args(WorkerServiceOptions, parser.parse_args(argv)).local_ranks == 2


def test_vllms_no_enable_prefix_caching_turns_prefix_caching_off():
    """A vLLM command line (`vllm serve ... --no-enable-prefix-caching`) was refused as an
    unrecognized argument."""
    _, args = _parse("--no-enable-prefix-caching")
    assert from_args(SchedulerConfig, args).enable_prefix_caching is False
    _, args = _parse()
    assert from_args(SchedulerConfig, args).enable_prefix_caching is True
