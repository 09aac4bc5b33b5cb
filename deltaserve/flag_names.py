"""A config's ParamError told in the words of the flag that set it.

The configs validate themselves by field name (max_num_seqs, step_timeout_s, local_ranks), the
right words for the offline API; on the command line the operator typed --max-num-seqs,
--step-timeout or --tensor-parallel-size, and an error naming local_ranks sent them looking for
a flag that does not exist. vLLM's argparse errors name the flag too.
"""
from __future__ import annotations

from functools import cache

from deltaserve.openai_gateway import OpenAIOptions
from engine_common.configuration.config import (SchedulerConfig, WorkerConfig,
                                                WorkerServiceOptions)
from engine_common.configuration.settings import declared
from engine_common.request.params import ParamError, quoted
from engine_common.security.worker_auth import WorkerCredentials
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.server import ServerOptions

_CONFIGS = (WorkerServiceOptions, WorkerCredentials, SchedulerConfig, WorkerConfig,
            ServerOptions, ApiOptions, OpenAIOptions)


@cache
def _flags_by_field() -> dict[str, tuple[str, str]]:
    """field -> its flag, and its aliases as a note, for the fields
    whose flag takes the field's own value (not --kv-cache-gib, which takes GiB of a byte
    count)."""
    out = {}
    for cls in _CONFIGS:
        for d in declared(cls):
            if d.setting.cli and d.setting.parse is None:
                aliases = ", ".join(d.setting.aliases)
                out.setdefault(d.name, (d.flag, f" ({aliases}: the same flag)" if aliases else ""))
    return out


def in_flag_words(error: ParamError) -> str:
    """The error's message, naming the flag where a flag sets that field."""
    named = _flags_by_field().get(error.field)
    if named is None:
        return str(error)
    flag, note = named
    return f"{flag}={quoted(error.value)} is invalid: must be {error.allowed}{note}"
