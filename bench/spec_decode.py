"""n-gram speculative decoding on an input-grounded workload: output tok/s with
`speculative_config` on and off, rounds alternating, and the drafts' acceptance rate.

    python -m bench.spec_decode                      # the default model (SmolLM2-135M), CPU
    python -m bench.spec_decode --rounds 3 --max-tokens 128 --num-speculative-tokens 4
    python -m bench.spec_decode --async-scheduling   # both engines with async scheduling
    python -m bench.spec_decode --workload json      # structured output: a JSON schema

Each prompt asks the chat model to repeat or lightly edit a given passage (greedy), so most of
its answer is in its prompt: the case prompt lookup is for. `--workload json`: each asks for a
record as JSON under a JSON-schema constraint (an example record in the same format is in the
prompt, the values in the text), so the drafts are masked by the grammar at every position.
Prints one line per run and the medians; nothing is written to a file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams

PASSAGES = [
    "The river rose slowly through the night, and by morning the lower fields were under a "
    "foot of brown water. The farmers moved their animals to the hill, where the old barn "
    "still stood, and waited for the rain to stop.",
    "To install the package, download the archive, unpack it into a directory of your choice, "
    "and run the setup script from that directory. The script checks your Python version, "
    "creates a virtual environment and installs every dependency.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, where chlorophyll absorbs mostly blue and red light and "
    "reflects green, which is why leaves look green to us.",
    "The meeting is moved from Tuesday to Thursday at ten in the morning, in the second floor "
    "conference room. Please bring the quarterly figures and the draft of the new budget, and "
    "send your comments on the draft before Wednesday noon.",
]
TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{}",
    "Rewrite the following passage, changing only the names of the days and places:\n\n{}",
]


RECORD_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "city", "role", "skills"],
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "city": {"type": "string", "maxLength": 30},
                   "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
                   "skills": {"type": "array", "items": {"type": "string", "maxLength": 20},
                              "maxItems": 4}}}
EXAMPLE = ('Text: Maria Lopez lives in Madrid and works as a designer; she knows figma, '
           'sketching and typography.\nJSON: {"name": "Maria Lopez", "city": "Madrid", '
           '"role": "designer", "skills": ["figma", "sketching", "typography"]}')
RECORDS = [
    "John Carter lives in Boston and works as an engineer; he knows python, rust and docker.",
    "Aiko Tanaka lives in Osaka and works as an analyst; she knows sql, excel and statistics.",
    "Peter Novak lives in Prague and works as a manager; he knows budgeting and hiring.",
    "Lena Fischer lives in Berlin and works as a designer; she knows css, figma and drawing.",
]


def json_conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write the record as JSON in the same format.\n\n"
              f"{EXAMPLE}\n\nText: {RECORDS[i % len(RECORDS)]}\nJSON:"}] for i in range(n)]


def conversations(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        out.append([{"role": "user", "content": task.format(PASSAGES[i % len(PASSAGES)])}])
    return out


def run_once(llm, chats, max_tokens: int, concurrency: int, temperature: float = 0.0,
             repetition_penalty: float = 1.0, constraint: Constraint | None = None
             ) -> tuple[float, list[list[int]]]:
    """Every conversation, `concurrency` at a time; (seconds, output ids of each). Sampled
    (temperature > 0): conversation i has seed i, so both engines draw the same tokens.
    `constraint`: every conversation's structured output."""
    start, ids = time.perf_counter(), []
    for i in range(0, len(chats), concurrency):
        part = chats[i:i + concurrency]
        sampling = [SamplingParams(temperature=temperature, seed=i + j,
                                   repetition_penalty=repetition_penalty)
                    for j in range(len(part))]
        outs = llm.chat(part, sampling, StoppingParams(max_tokens=max_tokens),
                        constraint=constraint)
        ids += [o.token_ids for o in outs]
    return time.perf_counter() - start, ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec_decode",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model directory (default: the default "
                   "model, SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8, help="conversations run at once")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above: sampled with a seed per conversation")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="vLLM's repetition_penalty for every conversation (1: off)")
    p.add_argument("--workload", choices=("passages", "json"), default="passages",
                   help="passages to repeat or edit; json: records as JSON under a JSON "
                   "schema (structured output)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="both engines schedule a step ahead (speculation then drafts over "
                   "the step in flight: docs/speculative-decoding.md)")
    args = p.parse_args(argv)

    from deltaserve.llm import LLM
    model = args.model
    if model is None:
        from deltaserve.default_model import ensure_default_model
        model = str(ensure_default_model())
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}
    kw = {"dtype": "float32", "async_scheduling": args.async_scheduling}
    engines = {"off": LLM(model, **kw), "on": LLM(model, speculative_config=spec, **kw)}
    chats, constraint = conversations(args.num_prompts), None
    if args.workload == "json":
        chats = json_conversations(args.num_prompts)
        constraint = Constraint("json_schema", json.dumps(RECORD_SCHEMA))
    work = (args.max_tokens, args.concurrency, args.temperature, args.repetition_penalty,
            constraint)
    for llm in engines.values():                  # warm-up (untimed): the same work once
        run_once(llm, chats, *work)
    engines["on"].scheduler.spec.stats = type(engines["on"].scheduler.spec.stats)(
        accepted_per_pos=[0] * args.num_speculative_tokens)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    texts = {}
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            elapsed, ids = run_once(engines[name], chats, *work)
            tokens = sum(map(len, ids))
            rates[name].append(tokens / elapsed)
            print(f"round {r} spec {name:3}: {tokens} tokens in {elapsed:.2f} s = "
                  f"{tokens / elapsed:.1f} tok/s", flush=True)
            texts[name] = ids
    stats = engines["on"].scheduler.spec.stats
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    for name in ("off", "on"):
        print(f"spec {name:3} output tok/s min / median / max: {min(rates[name]):.1f} / "
              f"{statistics.median(rates[name]):.1f} / {max(rates[name]):.1f}")
    print(f"median output tok/s: off {off:.1f}, on {on:.1f} ({on / off:.2f}x); same tokens "
          f"on and off: {texts['on'] == texts['off']}; async scheduling: "
          f"{args.async_scheduling}; workload: {args.workload}")
    print(f"drafts: {stats.num_drafts} requests-steps, {stats.num_draft_tokens} tokens, "
          f"{stats.num_accepted_tokens} accepted (acceptance {stats.acceptance_rate:.2f}; per "
          f"position {stats.accepted_per_pos}); mean accepted per draft "
          f"{stats.num_accepted_tokens / max(1, stats.num_drafts):.2f}; dropped (a guess over "
          f"the step in flight failed): {stats.num_dropped} requests-steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
