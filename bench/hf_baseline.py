"""The peer: transformers `generate()` on the same prompts, static batches, a few batch sizes.

Each batch is left-padded and decoded greedily for exactly the longest output length the workload
asks of it (min_new_tokens = max_new_tokens, so EOS never ends a row early), as nano-vllm's
comparison does. Throughput counts the tokens the workload asked for, not the padding rows
generate() keeps decoding after a shorter request would have finished: that waste is the cost of
static batching.

Each batch size runs the workload's batches in order until `time_budget_s` has passed (at least
one batch), so a slow small batch size does not take the whole run; the trial records how many
sequences it covered. A batch size that runs out of device memory ends the search upward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bench.workload import Workload


@dataclass(frozen=True)
class HFTrial:
    batch_size: int
    num_seqs: int            # sequences of the workload covered
    output_tokens: int       # tokens the workload asked of those sequences
    generated_tokens: int    # tokens generate() produced (rows run to the batch's longest)
    seconds: float
    error: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 and not self.error else 0.0


@dataclass(frozen=True)
class HFResult:
    trials: tuple[HFTrial, ...]

    @property
    def best(self) -> HFTrial | None:
        ok = [t for t in self.trials if not t.error]
        return max(ok, key=lambda t: t.tokens_per_s) if ok else None


def run_transformers(model_dir: str, workload: Workload, device: str, dtype: torch.dtype,
                     batch_sizes: list[int], time_budget_s: float,
                     warmup: bool = False) -> HFResult:
    """Load `model_dir` with transformers and time generate() at each batch size."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad_id = model.generation_config.pad_token_id or 0
    if warmup:
        _generate(model, workload.prompts[:2], 4, pad_id)
    trials = []
    for size in sorted({min(b, workload.num_seqs) for b in batch_sizes}):
        trial = _trial(model, workload, size, time_budget_s, pad_id)
        trials.append(trial)
        if trial.error:
            break
    del model
    _free_device_memory(device)
    return HFResult(tuple(trials))


def _trial(model, workload: Workload, batch_size: int, time_budget_s: float,
           pad_id: int) -> HFTrial:
    done = out_tokens = generated = 0
    _sync(model.device)
    start = time.perf_counter()
    try:
        while done < workload.num_seqs:
            prompts = workload.prompts[done:done + batch_size]
            lens = workload.output_lens[done:done + batch_size]
            _generate(model, prompts, max(lens), pad_id)
            done += len(prompts)
            out_tokens += sum(lens)
            generated += len(prompts) * max(lens)
            if time.perf_counter() - start >= time_budget_s:
                break
    except torch.OutOfMemoryError:
        _free_device_memory(str(model.device))
        return HFTrial(batch_size, done, out_tokens, generated, 0.0, "out of memory")
    _sync(model.device)
    return HFTrial(batch_size, done, out_tokens, generated, time.perf_counter() - start)


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], num_new: int, pad_id: int) -> None:
    """One left-padded greedy batch producing exactly `num_new` tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                   max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                   pad_token_id=pad_id)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _free_device_memory(device: str) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
