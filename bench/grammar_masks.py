"""Grammar engines side by side: mask time per token at the served vocabulary, and what each
engine accepts. Why DeltaServe uses llguidance (see docs/structured-output.md).

    python -m bench.grammar_masks                         # the default model's tokenizer
    python -m bench.grammar_masks --model DIR --rounds 5 --results-file bench/results.md

For every constraint below, each engine compiles it, then walks one fixed token trace (a valid
output, tokenized once): before each token it computes the mask (timed), then consumes the
token. Engines alternate within each round; a round's figure is the median per-token mask time
over all traces; the summary is min / median / max over rounds. Engines: llguidance (always) and
xgrammar when it is importable (it needs torch: `pip install xgrammar`; not a dependency).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from tokenizers import Tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
EMPLOYEE = {"type": "object", "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "role": {"enum": ["engineer", "manager", "designer"]},
    "skills": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "additionalProperties": False,
                "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                "required": ["city", "zip"]}},
    "required": ["name", "role", "skills", "address"]}
# (name, kind, value, a valid output): the timed workload.
CASES = [
    ("json_schema person", "json_schema", json.dumps(PERSON),
     '{"name": "Alejandro Gomez", "age": 25}'),
    ("json_schema nested", "json_schema", json.dumps(EMPLOYEE),
     '{"name": "Ann Lee", "role": "engineer", "skills": ["python", "rust", "sql"], '
     '"address": {"city": "New York", "zip": 10011}}'),
    ("json_object", "json_object", True,
     '{"name": "Felix", "age": 10, "tags": ["cat", "orange"], "owner": {"id": 7}}'),
    ("regex phone", "regex", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", "(555) 123-4567"),
    ("choice", "choice", ["yes", "no", "maybe"], "maybe"),
    ("grammar", "grammar", 'root ::= item ("," item)*\nitem ::= [a-z]+ " " [0-9]+',
     "apples 3,pears 12,plums 7"),
]
# (what, kind, value): does the engine accept it? (a feature matrix, not timed)
FEATURES = [
    ("schema: pattern", "json_schema", {"type": "string", "pattern": "^[a-z]+$"}),
    ("schema: format email", "json_schema", {"type": "string", "format": "email"}),
    ("schema: format date-time", "json_schema", {"type": "string", "format": "date-time"}),
    ("schema: minLength/maxLength", "json_schema",
     {"type": "string", "minLength": 2, "maxLength": 5}),
    ("schema: minimum/maximum", "json_schema", {"type": "integer", "minimum": 3, "maximum": 9}),
    ("schema: anyOf", "json_schema", {"anyOf": [{"type": "string"}, {"type": "integer"}]}),
    ("schema: oneOf", "json_schema", {"oneOf": [{"type": "string"}, {"type": "integer"}]}),
    ("schema: $ref/$defs", "json_schema",
     {"$defs": {"p": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/p"}}),
    ("schema: minItems/maxItems", "json_schema",
     {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}),
    ("schema: uniqueItems", "json_schema", {"type": "array", "uniqueItems": True}),
    ("schema: allOf", "json_schema", {"allOf": [{"type": "object"}, {"required": ["a"]}]}),
    ("schema: if/then", "json_schema", {"if": {"type": "string"}, "then": {"minLength": 1}}),
    ("schema: unknown keyword", "json_schema", {"type": "string", "x-foo": 1}),
    ("regex: look-ahead", "regex", "a(?=b)b"),
    ("regex: back-reference", "regex", r"(a)\1"),
    ("regex: \\d (Unicode digits)", "regex", r"\d+"),
    ("regex: non-greedy", "regex", "a+?b"),
    ("grammar: GBNF", "grammar", 'root ::= "a" [b-c]*'),
    ("grammar: Lark", "grammar", 'start: "a" B*\nB: /[b-c]/'),
]


@dataclass
class Trace:
    compile_s: float
    mask_s: list[float]           # per token, first mask included


class LLGuidance:
    name = "llguidance " + importlib.metadata.version("llguidance")

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_ids)

    def grammar(self, kind: str, value) -> str:
        if kind == "json_object":
            return llguidance.grammar_from("json_schema", '{"type": "object"}')
        if kind == "choice":
            return llguidance.grammar_from("choice", value)
        return llguidance.grammar_from(kind, value)

    def accepts(self, kind: str, value) -> str:
        text = json.dumps(value) if kind == "json_schema" else value
        return llguidance.LLMatcher.validate_grammar(self.grammar(kind, text)) or "yes"

    def run(self, kind: str, value, token_ids: list[int]) -> Trace:
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(kind, value))
        compile_s = time.perf_counter() - t0
        mask = allocate_token_bitmask(1, self.vocab_size)
        times = []
        for token in token_ids:
            t0 = time.perf_counter()
            fill_next_token_bitmask(matcher, mask)
            times.append(time.perf_counter() - t0)
            if not _allowed(mask[0], token) or not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token} of its trace ({kind})")
        return Trace(compile_s, times)


class XGrammar:
    def __init__(self, model_dir: Path, vocab_size: int):
        import transformers
        import xgrammar

        self.xgr = xgrammar
        self.name = "xgrammar " + importlib.metadata.version("xgrammar")
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir /
                                                                      "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, kind: str, value):
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(value, any_whitespace=True, strict_mode=True)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(value)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in value))
        return c.compile_grammar(value)

    def accepts(self, kind: str, value) -> str:
        try:
            self.compile(kind, json.dumps(value) if kind == "json_schema" else value)
            return "yes"
        except Exception as e:           # xgrammar raises RuntimeError / ValueError
            return str(e).splitlines()[0][:80] or type(e).__name__

    def run(self, kind: str, value, token_ids: list[int]) -> Trace:
        t0 = time.perf_counter()
        matcher = self.xgr.GrammarMatcher(self.compile(kind, value))
        compile_s = time.perf_counter() - t0
        mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for token in token_ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            if not _allowed(mask[0].numpy(), token) or not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token} of its trace ({kind})")
        return Trace(compile_s, times)


def _allowed(words: np.ndarray, token: int) -> bool:
    return bool((int(words[token // 32]) >> (token % 32)) & 1)


def _engines(model_dir: Path, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]):
    engines = [LLGuidance(tokenizer.to_str(), vocab_size, eos_ids)]
    try:
        engines.append(XGrammar(model_dir, vocab_size))
    except ImportError as e:
        print(f"xgrammar not measured: {e}")
    return engines


def _round(engines, traces) -> dict[str, tuple[list[float], list[float]]]:
    """engine name -> (per-token mask times, compile times), engines alternating per case."""
    out = {e.name: ([], []) for e in engines}
    for name, kind, value, ids in traces:
        for engine in engines:
            trace = engine.run(kind, value, ids)
            out[engine.name][0].extend(trace.mask_s[1:])     # first mask: reported apart
            out[engine.name][1].append(trace.compile_s + trace.mask_s[0])
    return out


def _model_facts(model_dir: Path) -> tuple[int, list[int]]:
    config = json.loads((model_dir / "config.json").read_text())
    gen = model_dir / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos = eos if eos is not None else config.get("eos_token_id")
    return int(config["vocab_size"]), eos if isinstance(eos, list) else [eos]


def run(model_dir: Path, rounds: int) -> list[str]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab_size, eos_ids = _model_facts(model_dir)
    engines = _engines(model_dir, tokenizer, vocab_size, eos_ids)
    traces = [(n, k, v, tokenizer.encode(text, add_special_tokens=False).ids)
              for n, k, v, text in CASES]
    lines = [f"model: {model_dir.name}, vocab {vocab_size}; {len(CASES)} constraints, "
             f"{sum(len(t[3]) for t in traces)} tokens per engine per round; {rounds} rounds"]
    medians = {e.name: [] for e in engines}
    firsts = {e.name: [] for e in engines}
    for r in range(rounds):
        for name, (masks, compiles) in _round(engines, traces).items():
            medians[name].append(statistics.median(masks))
            firsts[name].append(statistics.median(compiles))
            lines.append(f"round {r + 1}: {name}: mask per token median "
                         f"{statistics.median(masks) * 1e6:.0f} us, p90 "
                         f"{np.percentile(masks, 90) * 1e6:.0f} us, max {max(masks) * 1e6:.0f}"
                         f" us; compile + first mask median {statistics.median(compiles) * 1e3:.1f}"
                         " ms")
    for name in medians:
        lines.append(f"{name}: mask per token (median) {_mmm(medians[name], 1e6, 'us')}; "
                     f"compile + first mask (median) {_mmm(firsts[name], 1e3, 'ms')} "
                     "(min / median / max over rounds)")
    for what, kind, value in FEATURES:
        verdicts = [f"{e.name.split()[0]}: {e.accepts(kind, value).strip()[:80]}"
                    for e in engines]
        lines.append(f"accepts {what}: " + "; ".join(v.replace("\n", " ") for v in verdicts))
    return lines


def _mmm(values: list[float], scale: float, unit: str) -> str:
    return " / ".join(f"{x * scale:.1f}" for x in (min(values), statistics.median(values),
                                                  max(values))) + f" {unit}"


def _default_model_dir() -> Path:
    from deltaserve.default_model import ensure_default_model
    return Path(ensure_default_model())


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.grammar_masks",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="model directory with tokenizer.json (default: the default model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--results-file", type=Path, default=None, help="append the figures here")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    command = shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [f"commit: `{_commit()}`", f"command: `python -m bench.grammar_masks {command}`"]
    lines += run(args.model or _default_model_dir(), args.rounds)
    if args.note:
        lines.append(f"note: {args.note}")
    block = "\n".join(f"- {line}" for line in lines)
    print(block)
    if args.results_file:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with open(args.results_file, "a") as f:
            f.write(f"\n## {stamp} · grammar masks\n\n{block}\n")


if __name__ == "__main__":
    main()
