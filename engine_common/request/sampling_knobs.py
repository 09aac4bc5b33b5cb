"""Sampling knobs declared once: a SamplingParams field carries its neutral value, its range, its
batch column and its client flag.

    top_p: float = knob(1.0, "default: the server's (1)", lo=0.0, hi=1.0, lo_open=True, flag=True)

From that one declaration (engine_common/request/params.py) come: the validation
(SamplingParams.__post_init__), the field of both public APIs and of the step diff (the proto
field has the knob's name: engine_common/wire/sampling_wire.py's given_knobs reads any that a
message has; the diff carries the public SamplingParams message itself), the client flags
(`deltaserve generate` / `chat`: deltaserve/client.py), the generation_config.json keys and the
defaults vLLM publishes, the worker's batch column (InputBatch), its staging region and the
sampler's metadata column (worker_service/sample/sampling_metadata.py: None when every row is
neutral) and the diff's size bound (diff_limits.py). Adding a knob is one declaration plus its
use in the sampler.

NOTE the kinds of knob:
- a scalar with `column` (a numpy dtype name) has one value per batch row; `to_column` maps the
  request's value onto the column's (top_k's -1 and 0 are both "off": 0);
- a scalar without a column travels in the diff but has its own handling (seed: the scheduler
  draws one when unset, the batch keeps it in `seeds`);
- `ids=True`: a set of token ids (a tuple, ascending and distinct), each bounded by vocab_size
  at the edge; ragged per row in the batch, staged as (row, id) pairs in
  SamplingMetadata.id_sets[name]; `()` is neutral.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

_META = "deltaserve_knob"
MAX_LOGIT_BIAS = 1024           # logit_bias entries of one request (the public API's bound)
LOGIT_BIAS_RANGE = 100.0        # |bias| of one entry, as OpenAI's API


@dataclass(frozen=True)
class Knob:
    """The metadata of one declared knob (see the module docstring)."""

    help: str                        # the client flag's help; "" for no flag
    lo: float | None = None          # the allowed range: [lo, hi], ends open where said
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    column: str | None = "float32"   # the batch column's numpy dtype; None: no column
    always_staged: bool = False      # staged even when every row is neutral (temperature)
    needs_history: bool = False      # the sampler needs the rows' prompt and output ids
    generation_config: bool = False  # a generation_config.json key (and vLLM publishes it)
    ids: bool = False                # a set of token ids (see the module docstring)
    max_ids: int = 0                 # with ids: the most a request may send
    to_column: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class DeclaredKnob:
    """A knob with the field it was declared on."""

    name: str
    neutral: Any
    meta: Knob

    @property
    def column_neutral(self):
        """The column's value of a request that leaves the knob off."""
        return self.column_value(self.neutral)

    def column_value(self, value):
        return self.meta.to_column(value) if self.meta.to_column else value


def knob(neutral, help: str = "", **meta):
    """A dataclass field with its Knob; `neutral` (the value that switches it off) is the
    default."""
    return dataclasses.field(default=neutral, metadata={_META: Knob(help, **meta)})


def knobs_of(cls) -> tuple[DeclaredKnob, ...]:
    """The knobs declared on dataclass `cls`, in declaration order."""
    return tuple(DeclaredKnob(f.name, f.default, f.metadata[_META])
                 for f in dataclasses.fields(cls) if _META in f.metadata)
