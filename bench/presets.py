"""Named benchmark models: RANDOM weights in the exact shape of a real checkpoint.

Nothing is downloaded. The weights are transformers' own initialisation (std 0.02, seeded), saved
with `save_pretrained`; the tokenizer is the tiny test tokenizer (512 ids), which is enough since
the benchmark feeds random token ids and never needs text (ids the tokenizer lacks detokenize to
nothing). A preset with `borrow_tokenizer` (step-overhead) instead copies the tokenizer of a real
model directory and takes its vocabulary size, so detokenization costs what it does for real
text. A built preset is cached under `$XDG_CACHE_HOME/deltaserve/presets/NAME` (or
`~/.cache/...`) next to a `bench_preset.json` recording what it was built from; a preset whose
definition changed is rebuilt.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPEC_FILE = "bench_preset.json"


@dataclass(frozen=True)
class Preset:
    """One named architecture. `config` holds the HF config fields that give it its shape."""

    name: str
    arch: str                      # "qwen3" | "llama" | "tiny"
    dtype: str                     # the dtype the weights are saved in
    config: dict = field(default_factory=dict)
    seed: int = 0
    borrow_tokenizer: bool = False  # copy tokenizer and vocab size from a given model directory


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", "tiny", "float32"),
    Preset("qwen3-0.6b", "qwen3", "bfloat16", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
        attention_bias=False, hidden_act="silu")),
    Preset("llama-3.2-1b", "llama", "bfloat16", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
        rope_parameters=_LLAMA3_ROPE, rms_norm_eps=1e-5, max_position_embeddings=131072,
        attention_bias=False, mlp_bias=False, hidden_act="silu")),
    # The step-overhead workload's model: so small that the per-step work around the model
    # (LM head over a 49K vocabulary, sampler, batch upkeep, output processing) dominates.
    # head_dim 64 because vLLM's CPU attention rejects smaller heads; init 0.1 so greedy
    # top-2 margins are far above float noise.
    Preset("step-overhead", "llama", "float32", dict(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=768, tie_word_embeddings=True, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, attention_bias=False,
        mlp_bias=False, hidden_act="silu", initializer_range=0.1), borrow_tokenizer=True),
    # The long-prefill fairness workload's model (issue 23 item 3): 6 layers, like the issue's,
    # small enough that a 30,000-token prompt prefills in about a minute on a 2-core CPU.
    Preset("long-prefill", "llama", "float32", dict(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=768, tie_word_embeddings=True, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position_embeddings=32768, attention_bias=False,
        mlp_bias=False, hidden_act="silu")),
)}


class PresetNeedsTokenizer(ValueError):
    """A preset that borrows a real tokenizer was asked for without a model directory."""

    def __init__(self, name: str):
        super().__init__(f"tokenizer_dir=None is invalid for preset {name!r}: it borrows a real "
                         f"model's tokenizer and vocabulary; give that model's directory")


class UnknownPreset(ValueError):
    """A preset name that is not in PRESETS."""

    def __init__(self, name: str):
        super().__init__(f"preset={name!r} is invalid: must be one of {sorted(PRESETS)}")


def presets_cache_dir() -> Path:
    """Where built presets live: $XDG_CACHE_HOME/deltaserve/presets (or ~/.cache/...)."""
    from engine_common.runtime.paths import cache_dir

    return cache_dir() / "presets"


def preset_dir(name: str, cache_root: str | Path | None = None, device: str = "cpu",
               tokenizer_dir: str | Path | None = None) -> Path:
    """The model directory of preset `name`, built on first use (on `device`, then saved).
    tokenizer_dir: the model whose tokenizer a borrow_tokenizer preset copies (else ignored)."""
    preset = PRESETS.get(name)
    if preset is None:
        raise UnknownPreset(name)
    root = Path(cache_root) if cache_root is not None else presets_cache_dir()
    target = root / name
    spec = _spec_of(preset)
    if preset.borrow_tokenizer:
        if tokenizer_dir is None:
            raise PresetNeedsTokenizer(name)
        spec["tokenizer_dir"] = str(Path(tokenizer_dir).resolve())
    if _cached_spec(target) == spec:
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build_preset(preset, staging, device, spec.get("tokenizer_dir"))
        (staging / SPEC_FILE).write_text(json.dumps(spec, indent=1, sort_keys=True))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_preset(preset: Preset, out_dir: str | Path, device: str = "cpu",
                 tokenizer_dir: str | Path | None = None) -> Path:
    """Write `preset` as a Hugging Face model directory into out_dir."""
    if preset.arch == "tiny":
        from worker_service.models.tiny_model import make_tiny_model

        return make_tiny_model(out_dir, "qwen3", seed=preset.seed, **preset.config)
    return _build_random_model(preset, Path(out_dir), device, tokenizer_dir)


def _spec_of(preset: Preset) -> dict:
    return json.loads(json.dumps(asdict(preset), sort_keys=True))


def _cached_spec(target: Path) -> dict | None:
    try:
        spec = json.loads((target / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return None
    return spec if (target / "config.json").is_file() else None


def _model_class(arch: str):
    import transformers as tf

    return {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[arch]


def _build_random_model(preset: Preset, out: Path, device: str,
                        tokenizer_dir: str | Path | None = None) -> Path:
    """Random weights of the preset's shape, created in its dtype on `device`, saved to `out`."""
    import torch
    from transformers import GenerationConfig

    tok = _copy_tokenizer(Path(tokenizer_dir), out) if tokenizer_dir else _tiny_tokenizer(out)
    eos = tok["eos_token_id"]
    config_class, model_class = _model_class(preset.arch)
    fields = {**preset.config, **({"vocab_size": tok["vocab_size"]} if tokenizer_dir else {})}
    config = config_class(**fields, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(preset.seed)
    with torch.device(device):
        model = model_class._from_config(config, dtype=getattr(torch, preset.dtype))
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=eos, bos_token_id=eos, pad_token_id=eos,
                     do_sample=False).save_pretrained(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def _tiny_tokenizer(out: Path) -> dict:
    from engine_common.text.tiny_tokenizer import make_tiny_tokenizer_dir

    return make_tiny_tokenizer_dir(out)


def _copy_tokenizer(src: Path, out: Path) -> dict:
    """Copy a model directory's tokenizer files into out; returns its vocab size (the model's
    config.json) and first EOS id (generation_config.json, else config.json)."""
    from engine_common.model_files.model_dir import ModelInfo

    info = ModelInfo.from_dir(src)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    eos = info.eos_token_ids[0] if info.eos_token_ids else 0
    return {"vocab_size": info.vocab_size, "eos_token_id": eos}
