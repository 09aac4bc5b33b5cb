"""Real PEFT LoRA adapters for tiny models, and transformers + peft greedy references."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from tests.support.hf_reference import HFGreedy

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: str, out_dir: Path, *, r: int = 8, alpha: int = 16,
                 targets=ALL_TARGETS, seed: int = 0, use_rslora: bool = False,
                 **peft_options) -> str:
    """A PEFT LoRA directory over `model_dir` with random A and B (B != 0: init_lora_weights
    False), scaled up so the adapter changes the greedy tokens; `peft_options`: more
    LoraConfig fields (use_dora, modules_to_save, bias, ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                     init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.0,
                     **peft_options)
    adapted = get_peft_model(base, cfg)
    adapted.save_pretrained(str(out_dir))
    return str(out_dir)


@lru_cache(maxsize=8)
def peft_model(model_dir: str, adapter_dir: str | None, dtype: torch.dtype = torch.float32):
    """transformers' model of model_dir in `dtype` with the adapter applied by peft (None: the
    base), in eval mode and with no eos (greedy runs to max_new_tokens); cached."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.generation_config.eos_token_id = None
    return model.eval()


@lru_cache(maxsize=512)
def peft_greedy(model_dir: str, adapter_dir: str | None, prompt: tuple[int, ...],
                max_new_tokens: int) -> HFGreedy:
    """transformers' greedy generate() with the adapter applied by peft (None: the base)."""
    return model_greedy(peft_model(model_dir, adapter_dir), prompt, max_new_tokens)


def model_greedy(model, prompt: tuple[int, ...], max_new_tokens: int) -> HFGreedy:
    """A transformers model's greedy generate() of `prompt`, with its top-2 margins."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    margins = []
    for step in out.logits:
        top2 = step[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return HFGreedy(tuple(out.sequences[0, len(prompt):].tolist()), tuple(margins))


def peft_logits(model_dir: str, adapter_dir: str | None, ids: torch.Tensor) -> torch.Tensor:
    """transformers + peft's logits at every position of `ids` (one request; None: the base)."""
    with torch.no_grad():
        return peft_model(model_dir, adapter_dir)(input_ids=ids[None]).logits[0]


def check_lora_greedy(llm, prompts, names, max_new: int, ref) -> list:
    """llm.generate's greedy tokens of `prompts`, each under its adapter in `names` (None: the
    base), == ref(name, prompt) (an HFGreedy; divergences at near ties reported, not failed),
    and no leaked KV blocks; the outputs."""
    from engine_common.request.params import SamplingParams, StoppingParams
    from tests.support.engine_checks import assert_no_leaked_blocks
    from tests.support.hf_reference import assert_greedy_agrees, compare_greedy

    outs = llm.generate(prompts, SamplingParams(), StoppingParams(max_tokens=max_new,
                                                                 ignore_eos=True),
                        lora_request=list(names))
    near_ties, failures = [], []
    for i, (p, name, out) in enumerate(zip(prompts, names, outs)):
        failure = compare_greedy(f"{name}/prompt{i}", out.token_ids, ref(name, tuple(p)),
                                 near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)
    assert_no_leaked_blocks(llm)
    return outs


def token_slots(n: int):
    """A mixed step: the first third adapter slot 0, the middle the base (-1), the rest 1."""
    import numpy as np
    return np.array([0] * (n // 3) + [-1] * (n // 3) + [1] * (n - 2 * (n // 3)))


def lora_prefill_logits(model_dir: str, adapters: list[str], tp=None):
    """Prefill logits of paged_prefill.tp_ids() with the adapters attached, rows per
    token_slots."""
    from tests.support.paged_prefill import load, prefill_logits, tp_ids
    from worker_service.lora.adapter import read_adapter
    from worker_service.lora.families import lora_targets
    from worker_service.lora.layers import attach_lora

    model = load(model_dir, tp=tp)
    targets = lora_targets(model)
    state = attach_lora(model, [read_adapter(f"a{i}", p, 16, None, targets)
                                for i, p in enumerate(adapters)])
    ids = tp_ids()
    state.set_token_slots(token_slots(len(ids)))
    return prefill_logits(model, ids)


def lora_tp_worker(rank: int, port: int, model_dir: str, adapters: list[str],
                   out_dir: str, world_size: int = 2) -> None:
    """One of world_size gloo ranks: lora_prefill_logits on this rank's slices."""
    import torch.distributed as dist

    from worker_service.parallel_state import TPGroup
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        logits = lora_prefill_logits(model_dir, adapters,
                                     TPGroup(rank=rank, world_size=world_size))
        torch.save(logits, f"{out_dir}/lora_logits_{rank}.pt")
    finally:
        dist.destroy_process_group()


def bad_adapters(model_dir: str, root: Path, max_rank: int) -> dict[str, tuple[str, str]]:
    """Directories a server with --max-lora-rank `max_rank` must refuse, by case:
    case -> (path, a regex of the reason the refusal names)."""
    import shutil

    from safetensors.torch import load_file, save_file

    good = make_adapter(model_dir, root / "good", r=4, alpha=8, seed=5)
    half = root / "half"
    half.mkdir()
    shutil.copy(f"{good}/adapter_config.json", half)
    wide = root / "wide"
    shutil.copytree(good, wide)
    tensors = load_file(f"{wide}/adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = tensors[key].repeat(1, 2)          # in = 2 x hidden_size: another model
    save_file(tensors, f"{wide}/adapter_model.safetensors")
    garbled = root / "garbled"
    shutil.copytree(good, garbled)
    (garbled / "adapter_model.safetensors").write_bytes(   # a 16-byte header that is not JSON
        (16).to_bytes(8, "little") + b"\x00 not safetensors")
    listed = root / "listed"
    shutil.copytree(good, listed)
    (listed / "adapter_config.json").write_text("[1, 2]")
    deep = root / "deep"
    shutil.copytree(good, deep)
    (deep / "adapter_config.json").write_text("[" * 100_000)       # RecursionError in json
    return {
        "missing file": (str(half), r"adapter_model.safetensors does not exist"),
        "unreadable weights": (str(garbled), r"adapter_model.safetensors cannot be read"),
        "config not an object": (str(listed), r"adapter_config.json is not a JSON object"),
        "no directory": (str(root / "nowhere"), r"adapter_config.json does not exist"),
        "rank too large": (make_adapter(model_dir, root / "big", r=2 * max_rank, seed=6),
                           rf"r={2 * max_rank} is invalid: must be in \[1, "
                           rf"max_lora_rank={max_rank}\]"),
        "unsupported target": (make_adapter(model_dir, root / "head",
                                            targets=("q_proj", "lm_head"), r=4, seed=7),
                               r"target module\(s\) \['lm_head'\] are not supported"),
        "another model's shapes": (str(wide), r"q_proj: lora_A \(4, \d+\) does not fit"),
        **_bad_configs(good, root),
        "config nested too deep": (str(deep), r"adapter_config.json cannot be read "
                                              r"\(RecursionError"),
        **_huge_files(good, root),
    }


def _huge_files(good: str, root: Path) -> dict[str, tuple[str, str]]:
    """A valid adapter_config.json padded past MAX_CONFIG_BYTES (valid JSON: only its size is
    wrong), and a safetensors file whose header claims 50 MB (safetensors' own limit is 100 MB:
    it would read and parse all of it)."""
    import shutil

    from worker_service.lora.adapter import MAX_CONFIG_BYTES, MAX_HEADER_BYTES

    padded, header = root / "padded", root / "header"
    shutil.copytree(good, padded)
    cfg = (padded / "adapter_config.json").read_text()
    (padded / "adapter_config.json").write_text(cfg + " " * MAX_CONFIG_BYTES)
    shutil.copytree(good, header)
    (header / "adapter_model.safetensors").write_bytes((50_000_000).to_bytes(8, "little")
                                                      + b"{" + b" " * 1000)
    return {
        "config too large": (str(padded), rf"adapter_config.json: a file of "
                                          rf"{len(cfg) + MAX_CONFIG_BYTES} bytes is invalid: "
                                          rf"must be at most {MAX_CONFIG_BYTES} bytes"),
        "header too large": (str(header), rf"adapter_model.safetensors: a safetensors header "
                                          rf"of 50000000 bytes is invalid: must be at most "
                                          rf"{MAX_HEADER_BYTES} bytes"),
    }


def _bad_configs(good: str, root: Path) -> dict[str, tuple[str, str]]:
    """bad_adapters' cases of a good directory with one adapter_config.json field changed."""
    import json
    import shutil

    cases = {   # case -> (field, value, reason)
        "tensors' rank unlike r": ("r", 2, r"lora_A \(4, \d+\) has rank 4: "
                                          r"adapter_config.json says r=2"),
        "r not finite": ("r", float("inf"), r"r / lora_alpha in .* are not finite numbers"),
        "lora_alpha not finite": ("lora_alpha", float("nan"),
                                  r"r / lora_alpha in .* are not finite numbers"),
        "target_modules not names": ("target_modules", 5, r"target_modules=5 is invalid"),
        "alpha_pattern": ("alpha_pattern", {"q_proj": 64}, r"alpha_pattern=.* is not "
                                                           r"supported"),
    }
    out = {}
    for i, (case, (field, value, reason)) in enumerate(cases.items()):
        d = root / f"config{i}"
        shutil.copytree(good, d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, field: value}))
        out[case] = (str(d), reason)
    return out
