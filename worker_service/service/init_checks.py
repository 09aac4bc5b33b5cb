"""The checks an Init passes before the worker changes anything (a refused Init leaves the model,
the epoch and the owner as they were).

    model_dir             a path the file system can name: at most PATH_MAX bytes, each part at
                          most NAME_MAX (a 100,000-character one failed as an INTERNAL OSError
                          whose status, repeating it, exceeded gRPC's metadata limit)
    --model-root DIR      the model directory must resolve (symlinks followed) to a path under DIR,
                          and so must every --lora-modules directory and each file of it a rank
                          opens (a symlink inside it to /etc/... is refused too)
    max_model_len         in [2, the model's max_position_embeddings (stretched by a linear,
                          dynamic or YaRN factor: model_dir.model_position_limit)]: the field's rule
                          (a prompt token and an output token; RunnerConfig, before these
                          checks) and ModelInfo.from_dir (no override past the model's: its
                          rotary tables end there); `deltaserve serve` and the scheduler
                          refuse the same first
    runner settings       runner/preflight.py: everything a ModelRunner checks before its weights
    --max-message-mib     the largest step diff the settings allow must fit in one Worker message
    memory                runner/memory_fit.py: the weights, the LoRA stacks the flags allow and
                          the KV cache, estimated, must fit the machine (DoesNotFit:
                          FAILED_PRECONDITION)
    layout                node_rank, num_nodes and num_local_ranks as the worker was started
                          (`check_layout`, first of all)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from engine_common.request.diff_limits import max_diff_bytes
from engine_common.request.params import quoted
from worker_service.config import NodeLayout, RunnerConfig
from worker_service.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from worker_service.runner.memory_fit import check_memory_fits
from worker_service.runner.preflight import check_runner_config

MIB = 1 << 20
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)    # what a rank opens in a LoRA directory
PATH_MAX, NAME_MAX = 4096, 255     # Linux's, in bytes


@dataclass(frozen=True)
class InitGuards:
    """The worker process's limits on what an Init may ask for (its flags)."""

    model_root: str | None = None
    max_message_bytes: int = 256 * MIB


def check_init(config: RunnerConfig, guards: InitGuards, layout: NodeLayout) -> None:
    """ValueError (a refused setting), NotImplementedError (unsupported here) or DoesNotFit
    (more memory than the machine has) naming it."""
    check_path_shape(config.model_dir)
    check_model_root(config.model_dir, guards.model_root)
    for module in config.lora:
        check_lora_path(module.path, guards.model_root)
    info = check_runner_config(config, layout.tp_size)
    largest = max_diff_bytes(config.max_num_seqs, config.max_num_batched_tokens,
                             info.max_model_len, config.block_size)
    if largest > guards.max_message_bytes:
        raise ValueError(
            f"max_num_seqs={config.max_num_seqs} is invalid with max_model_len="
            f"{info.max_model_len}: a step diff may take {largest / MIB:.0f} MiB, more than this "
            f"worker's --max-message-mib {guards.max_message_bytes // MIB}")
    check_memory_fits(config, info, layout.tp_size, layout.num_local_ranks)


def check_layout(started: NodeLayout, requested: NodeLayout) -> None:
    """Init's layout must match the flags the worker was started with (ValueError naming both)."""
    for name, flag in (("node_rank", "--node-rank"), ("num_nodes", "--nodes"),
                       ("num_local_ranks", "--local-ranks")):
        want, got = getattr(started, name), getattr(requested, name)
        if want != got:
            raise ValueError(f"layout.{name}={got} is invalid: this worker was started with "
                             f"{flag} {want} (check the order and number of the scheduler's "
                             "--workers)")


def check_path_shape(model_dir: str) -> None:
    """ValueError, naming the path clipped, when no file system could hold it."""
    encoded = os.fsencode(model_dir)
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if len(encoded) > PATH_MAX or longest > NAME_MAX:
        raise ValueError(f"model_dir={quoted(model_dir)} is invalid: must be a path of at most "
                         f"{PATH_MAX} bytes, each part at most {NAME_MAX}")


def check_model_root(model_dir: str, root: str | None) -> None:
    if root is None:
        return
    real, real_root = os.path.realpath(model_dir), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise ValueError(f"model_dir={model_dir!r} is invalid: must be under this worker's "
                         f"--model-root {root}")


def check_lora_path(path: str, root: str | None) -> None:
    """A LoRA directory (LoadLora, --lora-modules; docs/lora.md): ValueError naming it when no
    file system could hold it, or when it or a file of it a rank opens (a symlink followed)
    is outside this worker's --model-root (which bounds every path a scheduler names)."""
    encoded = os.fsencode(path)
    if not path or len(encoded) > PATH_MAX:
        raise ValueError(f"lora_path={quoted(path)} is invalid: must be a path of 1 to "
                         f"{PATH_MAX} bytes")
    if root is None:
        return
    real_root = os.path.realpath(root)
    for opened in (path, *(os.path.join(path, name) for name in ADAPTER_FILES)):
        real = os.path.realpath(opened)
        if os.path.commonpath([real, real_root]) != real_root:
            what = "" if opened == path else f": {os.path.basename(opened)} resolves to {real}"
            raise ValueError(f"lora_path={quoted(path)} is invalid{what}: must be under this "
                             f"worker's --model-root {root}")
