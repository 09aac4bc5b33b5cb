"""vLLM's `vllm serve` flags that `deltaserve serve` has no setting for: accepted where their
effect here is harmless, refused (one line, before the model loads) where it would change
results. docs/cli.md ("Coming from vLLM") lists every flag's class; `VLLM_FLAGS` is the one
declaration the flags, the checks and that table's test derive from.

Flags whose meaning is ours already (--max-num-seqs, -tp, --seed, ...) are declared with their
settings, not here; `vllm_spellings` only rewrites vLLM's spellings of their values
(--dtype half, --max-model-len 32k) into ours.
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine_common.request.params import quoted

HARMLESS = "harmless"   # accepted; its effect here differs but cannot change an answer
REFUSED = "refused"     # refused for the values named in its check

# vLLM's quantization methods whose checkpoints we read (the marlin kernels are vLLM's way to
# run gptq / awq; the same weights): the checkpoint's quantization_config decides, as in vLLM.
_CHECKPOINT_QUANT = {"fp8": "fp8", "compressed-tensors": "compressed-tensors", "gptq": "gptq",
                     "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                     "mxfp4": "mxfp4", "gguf": "gguf"}


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag: its names, how argparse reads it, and what it does here.

    `refuse(value, args)` returns why a value is refused (the allowed values and what to use
    instead) or None when it is accepted."""

    names: tuple[str, ...]
    effect: str                               # docs: what the flag does on deltaserve serve
    kind: str = HARMLESS
    action: str | type = "store_true"         # an argparse action, or the type of a value
    refuse: Callable[[object, argparse.Namespace], str | None] | None = None


def _only(*allowed, instead: str) -> Callable[[object, argparse.Namespace], str | None]:
    def check(value, args) -> str | None:
        if str(value) in allowed:
            return None
        shown = " or ".join(allowed)
        return f"must be {shown} ({instead})"
    return check


def _json_empty(instead: str) -> Callable[[object, argparse.Namespace], str | None]:
    def check(value, args) -> str | None:
        try:
            parsed = json.loads(str(value))
        except ValueError:
            return f"must be JSON; only {{}} is served ({instead})"
        return None if parsed in ({}, None) else f"must be {{}} ({instead})"
    return check


def _task(value, args) -> str | None:
    if value in ("auto", "generate"):
        return None
    if value in ("embed", "embedding", "classify", "score", "reward"):
        return "must be generate (vLLM removed --task; here: --runner pooling)"
    return "must be auto or generate (vLLM removed --task; here: --runner generate|pooling)"


def _tokenizer(value, args) -> str | None:
    model = getattr(args, "model", None) or getattr(args, "model_tag", None)
    if model is not None and _same_path(value, model):
        return None
    return (f"must be the model itself ({model!r}): the tokenizer is read from the model "
            "directory (copy another tokenizer's files into it)")


def _same_path(a: str, b: str) -> bool:
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _auto_tool_choice(value, args) -> str | None:
    return None if getattr(args, "tool_call_parser", None) else (
        "needs --tool-call-parser (as in vLLM)")


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--trust-remote-code",), "accepted; checkpoint code is never run: a model whose "
             "architecture only its own code (config.json's auto_map) implements is refused at "
             "load, naming the architecture", action=argparse.BooleanOptionalAction),
    VllmFlag(("--enable-auto-tool-choice",), "accepted with --tool-call-parser, which turns "
             "on the gateway's tool-call parsing; without it refused, as vLLM refuses it",
             action="store_true", refuse=_auto_tool_choice),
    VllmFlag(("--disable-log-requests",), "accepted; requests are not logged (the metrics "
             "count them)", action="store_true"),
    VllmFlag(("--enable-log-requests",), "accepted; requests are not logged (the metrics count "
             "them)",
             action=argparse.BooleanOptionalAction),
    VllmFlag(("--disable-log-stats",), "accepted; no periodic stats lines are logged (the "
             "/metrics endpoint has them)", action="store_true"),
    VllmFlag(("--swap-space",), "accepted; a preempted request's KV blocks are recomputed, "
             "never swapped to host memory (the same tokens)", action=float),
    VllmFlag(("--enable-chunked-prefill",), "accepted; chunked prefill is always on (the "
             "same tokens either way)", action=argparse.BooleanOptionalAction),
    VllmFlag(("--enable-prefix-caching",), "accepted; prefix caching is on by default "
             "(--no-enable-prefix-caching turns it off)", action="store_true"),
    VllmFlag(("--uvicorn-log-level",), "accepted; the gateway (smg) has its own log level",
             action=str),
    VllmFlag(("--root-path",), "accepted; the routes stay /v1/... (vLLM's root_path only "
             "changes the URLs its OpenAPI page shows)", action=str),
    VllmFlag(("--limit-mm-per-prompt",), "accepted; no image, audio or video input is "
             "served (text only), so every limit is 0 here", action=str),
    VllmFlag(("--quantization", "-q"), "the checkpoint's quantization_config decides, as in "
             "vLLM: a method it does not name is refused at load (no online quantization)",
             REFUSED, str, _only(*_CHECKPOINT_QUANT, instead="a quantized checkpoint of that "
                                 "method; nothing is quantized at load")),
    VllmFlag(("--load-format",), "auto, safetensors and gguf read the model directory; others "
             "refused", REFUSED, str, _only("auto", "safetensors", "gguf", instead="weights "
                                              "in safetensors or GGUF files")),
    VllmFlag(("--tokenizer",), "accepted when it names the model itself; another tokenizer "
             "refused", REFUSED, str, _tokenizer),
    VllmFlag(("--tokenizer-mode",), "auto and hf: the model's fast tokenizer; others refused",
             REFUSED, str, _only("auto", "hf", instead="the model's tokenizer.json")),
    VllmFlag(("--revision",), "main accepted (the cache's snapshot); another revision refused",
             REFUSED, str, _only("main", instead="give that revision's snapshot directory as "
                                 "MODEL")),
    VllmFlag(("--response-role",), "assistant accepted; another role refused", REFUSED, str,
             _only("assistant", instead="chat answers have the role assistant")),
    VllmFlag(("--override-generation-config",), "{} accepted; overrides refused", REFUSED,
             str, _json_empty("write them into a generation_config.json and give its "
                              "directory as --generation-config DIR")),
    VllmFlag(("--num-scheduler-steps",), "1 accepted (vLLM v1 removed the flag); more refused",
             REFUSED, int, _only("1", instead="--async-scheduling overlaps steps")),
    VllmFlag(("--distributed-executor-backend",), "mp and uni accepted (rank processes on "
             "this machine); ray and external_launcher refused", REFUSED, str,
             _only("mp", "uni", instead="several machines: `deltaserve worker` on each, "
                   "docs/tensor-parallel.md")),
    VllmFlag(("--pipeline-parallel-size", "-pp"), "1 accepted; more refused", REFUSED, int,
             _only("1", instead="no pipeline parallelism: --tensor-parallel-size")),
    VllmFlag(("--data-parallel-size", "-dp"), "1 accepted; more refused", REFUSED, int,
             _only("1", instead="one `deltaserve serve` per replica behind a router")),
    VllmFlag(("--task",), "auto and generate accepted (vLLM removed the flag); a pooling task "
             "refused", REFUSED, str, _task),
)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of VLLM_FLAGS, in a group of their own; an absent flag leaves no attribute."""
    group = parser.add_argument_group("vLLM's flags (docs/cli.md, Coming from vLLM)")
    for flag in VLLM_FLAGS:
        takes_value = not isinstance(flag.action, str) and not issubclass(flag.action,
                                                                           argparse.Action)
        kwargs = ({"type": flag.action, "metavar": "VALUE"} if takes_value
                  else {"action": flag.action})
        group.add_argument(*flag.names, dest=_dest(flag), default=argparse.SUPPRESS,
                           help=flag.effect, **kwargs)


def vllm_flag_problem(args: argparse.Namespace) -> str | None:
    """The first vLLM flag given with a value that is refused, in one line, or None."""
    for flag in VLLM_FLAGS:
        if not hasattr(args, _dest(flag)):
            continue
        value = getattr(args, _dest(flag))
        why = None if flag.refuse is None else flag.refuse(value, args)
        if why is not None:
            given = "" if isinstance(value, bool) else f"={quoted(value)}"
            return f"{flag.names[0]}{given} is invalid: {why}"
    return None


def quantization_problem(args: argparse.Namespace, hf_config: dict,
                         model_path: str) -> str | None:
    """What -q must be, when it names a method the checkpoint is not quantized with (vLLM
    would quantize at load, fp8, or refuse; we never quantize at load); None when it is fine."""
    value = getattr(args, "vllm_quantization", None)
    if value is None:
        return None
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    method = "gguf" if str(model_path).endswith(".gguf") else method
    if _CHECKPOINT_QUANT.get(value) == method:
        return None
    return (f"the checkpoint's method (its quantization_config.quant_method is {method!r}): "
            "nothing is quantized at load")


def _dest(flag: VllmFlag) -> str:
    return "vllm_" + flag.names[0].lstrip("-").replace("-", "_")


# vLLM's spellings of the values of flags we share: --dtype half, --max-model-len 32k / -1.
_DTYPES = {"half": "float16", "float": "float32"}
# vLLM's human_readable_int: a lower-case suffix is decimal (decimals allowed: 25.6k), an
# upper-case one binary (a whole number only).
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


# Shared flags whose values vLLM spells its way: --dtype's names, and the token counts its
# arg_utils reads with human_readable_int (--max-model-len also -1 / auto).
_SPELLED = ("--dtype", "--max-model-len", "--max-num-batched-tokens")


def vllm_spellings(argv: list[str]) -> list[str]:
    """argv with vLLM's spellings in ours: a flag's underscores as dashes (--max_model_len, as
    vLLM's parser reads it), shared flags' values (a value we cannot read is left for the
    flag's own error). --max-model-len -1 or auto: the model's (our unset)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = _dashed(argv[i]).partition("=")
        if name in _SPELLED and (eq or i + 1 < len(argv)):
            if not eq:
                i += 1
                value = argv[i]
            spelled = _spelled(name, value)
            out.extend([] if spelled is None else [f"{name}={spelled}"])
        else:
            out.append(name + eq + value)
        i += 1
    return out


def _dashed(arg: str) -> str:
    """--a_b[=v] as --a-b[=v] (vLLM's parser takes either); any other argument as given."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def _spelled(name: str, value: str) -> str | None:
    if name == "--dtype":
        return _DTYPES.get(value, value)
    auto = name == "--max-model-len"
    if auto and (value.strip() == "-1" or value.strip().lower() == "auto"):
        return None                      # the model's length: the flag left unset
    match = _HUMAN_INT.fullmatch(value.strip())
    if match is None:
        return value
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return str(int(float(number) * _DECIMAL[suffix]))
    return str(int(number) * _BINARY[suffix]) if number.isdigit() else value


def near_miss(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """" (did you mean --x?)" for the first unknown flag close to one of `parser`'s, else ""."""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for arg in unknown:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.partition("=")[0], known, n=1, cutoff=0.8)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""
