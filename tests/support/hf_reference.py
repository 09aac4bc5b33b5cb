"""Greedy reference outputs from transformers' own generate() on the same weights."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

NEAR_TIE = 1e-5


@dataclass(frozen=True)
class HFGreedy:
    token_ids: tuple[int, ...]
    margins: tuple[float, ...]  # top-1 minus top-2 logit at each generated step


@lru_cache(maxsize=4)
def _load(model_dir: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # compare fixed-length continuations
    return model


def hf_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' model on the same weights (loaded once; eos off: fixed-length output)."""
    return _load(model_dir, dtype, device)


@lru_cache(maxsize=512)
def hf_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int,
              dtype: torch.dtype = torch.float32, device: str = "cpu") -> HFGreedy:
    model = _load(model_dir, dtype, device)
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return HFGreedy(tuple(tokens), tuple(margins))


def compare_greedy(name: str, ours: list[int], ref: HFGreedy, near_ties: list[str]) -> str | None:
    """None when equal. A divergence on a near-tie step is recorded in near_ties (reported by
    name); any other divergence is returned as a failure message."""
    for i, (a, b) in enumerate(zip(ours, ref.token_ids)):
        if a != b:
            if ref.margins[i] < NEAR_TIE:
                near_ties.append(f"{name}: step {i} ours={a} hf={b} margin={ref.margins[i]:.2e}")
                return None
            return (f"{name}: step {i} ours={a} hf={b} (hf top-2 margin {ref.margins[i]:.3e})\n"
                    f"  ours={ours}\n  hf  ={list(ref.token_ids)}")
    if len(ours) != len(ref.token_ids):
        return f"{name}: lengths differ: ours {len(ours)} hf {len(ref.token_ids)}"
    return None


def assert_greedy_agrees(failures: list[str], near_ties: list[str]) -> None:
    """Print the near ties compare_greedy recorded (reported, not failures), then fail with every
    divergence it returned."""
    for tie in near_ties:
        print("NEAR TIE (reported, not a failure):", tie)
    assert not failures, "\n".join(failures)


@lru_cache(maxsize=64)
def hf_greedy_allowed(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int,
                      allowed: tuple[int, ...]) -> tuple[int, ...]:
    """transformers' greedy generate() restricted to `allowed` at every step
    (prefix_allowed_tokens_fn: every other id's score -inf), float32 on the CPU."""
    model = _load(model_dir, torch.float32, "cpu")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0,
                             prefix_allowed_tokens_fn=lambda batch, seq: list(allowed))
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy_guided(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int, matcher,
                     eos_ids) -> tuple[int, ...]:
    """transformers' greedy generate() under a grammar: at every step only the ids a fresh
    llguidance `matcher` allows after the tokens so far (prefix_allowed_tokens_fn), float32 on
    the CPU; the output ends at its first eos id, as a constrained request does."""
    model = _load(model_dir, torch.float32, "cpu")
    vocab = model.config.vocab_size
    seen = {"n": 0, "ended": False}

    def allowed(_batch, seq):
        new = seq[len(prompt):].tolist()
        for token in new[seen["n"]:]:
            if token in eos_ids:
                seen["ended"] = True
            elif not seen["ended"] and not matcher.consume_token(token):
                raise AssertionError(f"the grammar refused {token}: {matcher.get_error()}")
        seen["n"] = len(new)
        if seen["ended"]:
            return [min(eos_ids)]
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:vocab]
        return np.flatnonzero(bits).tolist()

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0,
                             prefix_allowed_tokens_fn=allowed)
    tokens = out[0, len(prompt):].tolist()
    end = next((i for i, t in enumerate(tokens) if t in eos_ids), len(tokens) - 1)
    return tuple(tokens[:end + 1])
