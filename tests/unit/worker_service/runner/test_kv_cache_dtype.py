"""--kv-cache-dtype fp8 end to end on a tiny real Llama (float32), against transformers.

Two references on the same weights:
  * transformers with its keys (after the rotary embedding, where we cache them) and values
    rounded to the same fp8 type: what our fp8 cache computes, so the prompt logprobs agree to
    float32 noise (TIGHT; a value on a rounding boundary may round the other way), and greedy
    tokens match wherever its top-2 margin exceeds 2 x TIGHT (asserted for the prompt);
  * plain transformers (float32 keys and values): the logprobs differ by fp8's rounding. The
    bound is GAIN x the unit roundoff u (e5m2: 2^-3, e4m3: 2^-4): keys and values carry a
    relative error of at most u, which this random model (initializer_range 0.3, logits spread
    over ~10 nats) amplifies by up to ~17 on PROMPT (measured: 2.09 nats at e5m2, 0.80 at
    e4m3); GAIN = 24 leaves room. Greedy tokens against plain transformers would need a top-2
    margin above 2 x GAIN x u (3 nats at e4m3); none of 150 prompts searched (runs and repeats
    of ids 3..199) has one over 6 steps (the largest smallest margin: 1.31), so greedy tokens
    are checked against the fp8-rounded reference above, whose margins are asserted.
`auto` is unchanged: exactly transformers' numbers, as before.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers.models.llama.modeling_llama as hf_llama

from deltaserve import cli
from deltaserve.llm import LLM
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import ParamError, StoppingParams
from tests.support.hf_reference import hf_greedy, hf_model
from tests.support.prompt_logprobs_reference import hf_prompt_logprobs
from worker_service.config import RunnerConfig
from worker_service.failures import DoesNotFit
from kernels.attention import selector
from kernels.attention.selector import CacheLayout, resolve_backend_name
from worker_service.runner.kv_dtype import fp8_problem, kv_cache_dtype, kv_cache_dtype_name
from worker_service.runner.memory_fit import check_memory_fits, estimate_kv_bytes, kv_room_bytes

PROMPT = list(range(5, 29))              # 24 tokens: six prefill chunks of 4, then decodes
FP8 = {"fp8": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2,
       "fp8_e4m3": torch.float8_e4m3fn}
UNIT_ROUNDOFF = {torch.float8_e5m2: 2.0 ** -3, torch.float8_e4m3fn: 2.0 ** -4}
GAIN = 24.0
TIGHT = 2e-3


def _llm(model: str, **kw) -> LLM:
    kw = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4,
          "max_num_batched_tokens": 4, **kw}
    return LLM(model, **kw)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate([prompt], None, StoppingParams(max_tokens=1, ignore_eos=True),
                       num_prompt_logprobs=4)[0]
    return torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])


def _hf_fp8_logits(model_dir: str, ids: list[int], dtype: torch.dtype,
                   monkeypatch) -> torch.Tensor:
    """transformers' logits [T, V] with keys and values rounded to `dtype` (saturating)."""
    hf = hf_model(model_dir)
    limit = torch.finfo(dtype).max

    def round_(x):
        return x.clamp(-limit, limit).to(dtype).to(x.dtype)

    def rope(q, k, *args, **kwargs):
        q, k = original(q, k, *args, **kwargs)
        return q, round_(k)

    original = hf_llama.apply_rotary_pos_emb
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, o: round_(o))
             for layer in hf.model.layers]
    try:
        with monkeypatch.context() as patch, torch.no_grad():
            patch.setattr(hf_llama, "apply_rotary_pos_emb", rope)
            return hf(torch.tensor([ids])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()


def _hf_fp8_logprobs(model_dir, prompt, dtype, monkeypatch) -> torch.Tensor:
    lp = _hf_fp8_logits(model_dir, prompt, dtype, monkeypatch).log_softmax(-1)
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def _hf_fp8_greedy(model_dir, prompt, steps, dtype, monkeypatch):
    """(tokens, top-2 margins) of greedy decoding on fp8-rounded keys and values."""
    ids, margins = list(prompt), []
    for _ in range(steps):
        top2 = _hf_fp8_logits(model_dir, ids, dtype, monkeypatch)[-1].topk(2)
        margins.append(float(top2.values[0] - top2.values[1]))
        ids.append(int(top2.indices[0]))
    return tuple(ids[len(prompt):]), margins


def _hf_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    return torch.tensor([e[0] for e in hf_prompt_logprobs(model_dir, tuple(prompt), 4)[1:]])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", list(FP8))
def test_fp8_logprobs_match_transformers_on_fp8_keys_and_values(model, name, backend,
                                                                monkeypatch):
    llm = _llm(model, kv_cache_dtype=name, attention_backend=backend)
    assert all(c.dtype == FP8[name] for c in llm.runner.kv_caches)
    got = _prompt_logprobs(llm, PROMPT)
    want = _hf_fp8_logprobs(model, PROMPT, FP8[name], monkeypatch)
    torch.testing.assert_close(got, want, atol=TIGHT, rtol=0)
    loose = GAIN * UNIT_ROUNDOFF[FP8[name]]
    plain = _hf_logprobs(model, PROMPT)
    assert (got - plain).abs().max() <= loose, (got - plain).abs().max()
    assert (got - plain).abs().max() > 0      # the cache really is fp8


@pytest.mark.parametrize("name", list(FP8))
def test_greedy_tokens_match_transformers_on_fp8_keys_and_values(model, name, monkeypatch):
    tokens, margins = _hf_fp8_greedy(model, PROMPT, 8, FP8[name], monkeypatch)
    assert min(margins) > 2 * TIGHT, margins             # the premise (module docstring)
    out = _llm(model, kv_cache_dtype=name).generate(
        [PROMPT], None, StoppingParams(max_tokens=8, ignore_eos=True))[0]
    assert tuple(out.token_ids) == tokens


def test_auto_is_the_model_dtype_and_exact(model):
    llm = _llm(model)
    assert all(c.dtype == torch.float32 for c in llm.runner.kv_caches)
    torch.testing.assert_close(_prompt_logprobs(llm, PROMPT), _hf_logprobs(model, PROMPT),
                               atol=1e-4, rtol=0)


def test_one_byte_per_value_holds_four_times_the_float32_blocks(model):
    budget = 1 << 20
    auto = _llm(model, num_kv_blocks=None, kv_cache_bytes=budget)
    fp8 = _llm(model, num_kv_blocks=None, kv_cache_bytes=budget, kv_cache_dtype="fp8")
    assert auto.runner.kv_block_bytes == 4 * fp8.runner.kv_block_bytes
    assert fp8._num_blocks == budget // fp8.runner.kv_block_bytes == 4 * auto._num_blocks
    assert sum(c.nbytes for c in fp8.runner.kv_caches) <= budget


@pytest.mark.parametrize("value", ["fp16", "FP8", "", "e5m2"])
def test_bad_values_are_refused_with_the_field_named(model, value):
    with pytest.raises(ParamError, match=f"kv_cache_dtype={value!r}|kv_cache_dtype=.*invalid"):
        _llm(model, kv_cache_dtype=value)


@pytest.mark.parametrize("arch,overrides,why", [
    ("gpt_oss", {}, "attention sinks"),
    ("mistral", {"sliding_window": 8}, "sliding-window"),     # every layer windowed
    ("gemma3", {}, "sliding-window"),                          # hybrid KV pools
    ("deepseek_v2", {}, "latent")])
def test_layouts_not_built_are_refused_at_start(tiny_models, arch, overrides, why):
    with pytest.raises(ValueError, match=f"--kv-cache-dtype fp8 is refused.*{why}"):
        _llm(tiny_models(arch, **overrides), kv_cache_dtype="fp8")


def test_backends_not_built_are_refused_by_name():
    """flash-attn reads the model dtype only; triton, torch and cpu read fp8 caches."""
    why = fp8_problem("fp8_e4m3", latent=False, sinks=False, windows=(), backend="flash_attn")
    assert why.startswith("--kv-cache-dtype fp8_e4m3 is refused")
    assert "attention_backend='flash_attn'" in why and "triton" in why, why
    for backend in ("triton", "torch", "cpu"):
        assert fp8_problem("fp8", latent=False, sinks=False, windows=(), backend=backend) is None
    assert fp8_problem("auto", latent=True, sinks=True, windows=(8,),
                       backend="flash_attn") is None


def test_sinks_and_windows_run_on_triton_only():
    for sinks, windows, what in ((True, (), "attention sinks"), (False, (0, 8), "sliding")):
        assert fp8_problem("fp8", latent=False, sinks=sinks, windows=windows,
                           backend="triton") is None
        why = fp8_problem("fp8", latent=False, sinks=sinks, windows=windows, backend="cpu")
        assert what in why and "attention_backend='cpu'" in why and "triton" in why, why
    why = fp8_problem("fp8", latent=True, sinks=False, windows=(), backend="triton")
    assert "latent (MLA)" in why, why


def test_plain_fp8_is_e4m3_on_cuda_and_e5m2_on_the_cpu():
    """vLLM's meanings (CUDA: float8_e4m3fn; CPU: e5m2), and the names workers echo."""
    assert kv_cache_dtype("fp8", torch.bfloat16, "cuda") == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8", torch.bfloat16, "cpu") == torch.float8_e5m2
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16, "cuda") == torch.float8_e5m2
    assert kv_cache_dtype("auto", torch.float16, "cuda") == torch.float16
    assert kv_cache_dtype_name(torch.float8_e4m3fn, torch.bfloat16) == "fp8_e4m3"
    assert kv_cache_dtype_name(torch.float32, torch.float32) == "auto"
    with pytest.raises(ValueError, match="cache_dtype=torch.float16 is invalid"):
        kv_cache_dtype_name(torch.float16, torch.bfloat16)


def test_auto_backend_takes_triton_over_flash_attn_for_an_fp8_cache(monkeypatch):
    """On CUDA `auto` prefers flash-attn where it fits; it cannot read fp8, so Triton serves."""
    monkeypatch.setattr(selector.importlib.util, "find_spec", lambda name: object())
    layout = CacheLayout(256, 128, torch.bfloat16)
    assert resolve_backend_name("auto", "cuda", layout) == "flash_attn"
    fp8 = dataclasses.replace(layout, kv_fp8=True)
    assert resolve_backend_name("auto", "cuda", fp8) == "triton"


def test_serve_refuses_a_bad_value_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", "--model", "/nonexistent/model", "--kv-cache-dtype", "fp16"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "'fp16'" in err and "fp8_e4m3" in err, err


def test_blocks_counted_at_one_byte_fit_where_float32_blocks_do_not(model):
    """memory_fit's estimate of num_kv_blocks counts --kv-cache-dtype's byte per value."""
    info = ModelInfo.from_dir(model)
    config = json.loads((Path(model) / "config.json").read_text())
    blocks = 1 << 16
    fp32_kv = estimate_kv_bytes(RunnerConfig(model_dir=model, num_kv_blocks=blocks), config, 4)
    machine = kv_room_bytes(RunnerConfig(model_dir=model), info, 1, 1, 1 << 40)[1] \
        + fp32_kv // 2             # the weights, and half the float32 cache
    fp8 = RunnerConfig(model_dir=model, num_kv_blocks=blocks, dtype="float32",
                       kv_cache_dtype="fp8")
    check_memory_fits(fp8, info, 1, 1, machine_bytes=machine)
    with pytest.raises(DoesNotFit):
        check_memory_fits(dataclasses.replace(fp8, kv_cache_dtype="auto"), info, 1, 1,
                          machine_bytes=machine)


def test_refused_before_the_weights_are_read(tiny_models, tmp_path):
    """A layout known from config.json alone (GPT-OSS's sinks) is refused before load_model
    reads a byte of the weights: here they are unreadable, and the error is still the flag's."""
    model = tmp_path / "gpt_oss"
    shutil.copytree(tiny_models("gpt_oss"), model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 is refused.*attention sinks"):
        _llm(str(model), kv_cache_dtype="fp8")
