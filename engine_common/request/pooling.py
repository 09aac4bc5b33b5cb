"""How a pooling (embedding) request turns its prompt's hidden states into one vector.

vLLM's `--runner pooling` embed task: the final hidden states (after the model's last norm, before
the LM head), pooled over the prompt, then optionally L2-normalised. The default for a decoder
model is LAST with normalisation (vLLM's embed default); a sentence-transformers directory's
`modules.json` and `1_Pooling/config.json` override it (vLLM reads them too), and
`--pooler-config '{"pooling_type": "MEAN", "normalize": false}'` overrides both.

On the step protocol a request's pooling travels as one int (`code`): the type's index, plus
NORMALIZE when the vector is normalised, plus WHOLE_PROMPT for an encoder model's request, plus
CLASSIFY for a sequence-classification model's (the pooled row goes through its score head: the
vector is the logits), plus a sentence pair's second-text start shifted by PAIR_SHIFT (its
token type 1 rows, for a model with token types); NO_POOLING for a generation request.

Encoder embedding models (BERT, RoBERTa, XLM-R: ENCODER_ARCHITECTURES) attend both ways, so a
prompt must be computed in one step (WHOLE_PROMPT: never chunked, never a prefix-cache hit);
they have no LM head, so they serve only --runner pooling, and default to CLS pooling as vLLM's
BertEmbeddingModel does. No pooling request samples: it finishes on its vector.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine_common.request.params import SamplingParams, StoppingParams

NO_POOLING = -1
# Pooling types, by their index on the wire.
LAST, MEAN, CLS = 0, 1, 2
POOLING_TYPES = {"LAST": LAST, "MEAN": MEAN, "CLS": CLS}
NORMALIZE = 4
WHOLE_PROMPT = 8        # a bidirectional (encoder) model's request: its prompt in one step
CLASSIFY = 16           # a classification model's request: the vector is its head's logits
PAIR_SHIFT = 5          # code >> PAIR_SHIFT: the first token of type 1 (0: all type 0)
_TYPE_MASK = 3
# A pooling request's sampling and stopping: it samples nothing (its one output is the vector,
# hence max_tokens=1 in the scheduler's counts); greedy so no seed matters.
POOL_SAMPLING = SamplingParams(temperature=0.0)
POOL_STOPPING = StoppingParams(max_tokens=1)
# config.json architectures served as encoder embedding models (worker_service/models/bert.py).
# Sequence classification (cross-encoder) heads; all of them serve --runner pooling only.
ENCODER_CLASSIFIERS = frozenset({"BertForSequenceClassification",
                                 "RobertaForSequenceClassification",
                                 "XLMRobertaForSequenceClassification"})
DECODER_CLASSIFIERS = frozenset({"LlamaForSequenceClassification",
                                 "Qwen2ForSequenceClassification",
                                 "Qwen3ForSequenceClassification"})
ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForMaskedLM", "RobertaModel",
                                   "RobertaForMaskedLM", "XLMRobertaModel",
                                   "XLMRobertaForMaskedLM"}) | ENCODER_CLASSIFIERS

# sentence-transformers module classes a directory may list: what they do is done here.
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# 1_Pooling/config.json's mode flags -> our type.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}


class PoolerConfigError(ValueError):
    """A pooler configuration (flag or model files) this engine cannot honour."""


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    whole_prompt: bool = False      # an encoder model: each prompt computed in one step
    classify: bool = False          # a classification model: the vector is its head's logits

    @property
    def code(self) -> int:
        """The int the step protocol carries for a request pooled this way."""
        return (POOLING_TYPES[self.pooling_type] | (NORMALIZE if self.normalize else 0)
                | (WHOLE_PROMPT if self.whole_prompt else 0)
                | (CLASSIFY if self.classify else 0))


def with_pair_start(code: int, pair_start: int) -> int:
    """`code` for a sentence pair whose second text (token type 1) starts at `pair_start`."""
    return code | (pair_start << PAIR_SHIFT)


def pair_start(code: int) -> int:
    """The first position of token type 1 (0: every position is type 0)."""
    return 0 if code == NO_POOLING else code >> PAIR_SHIFT


def is_classify(code: int) -> bool:
    """A classification model's request: its vector goes through the model's score head."""
    return code != NO_POOLING and bool(code & CLASSIFY)


def decode_code(code: int) -> tuple[int, bool]:
    """(pooling type index, normalize) of a wire code; ValueError for a code no config makes."""
    kind, normalize = code & _TYPE_MASK, bool(code & NORMALIZE)
    if code < 0 or kind not in POOLING_TYPES.values():
        raise ValueError(f"pooling code {code}: expected a type in 0..{len(POOLING_TYPES) - 1}, "
                         f"plus {NORMALIZE} to normalise, plus {WHOLE_PROMPT} for an encoder, "
                         f"plus {CLASSIFY} for a classifier, plus a pair start << {PAIR_SHIFT}")
    return kind, normalize


def is_whole_prompt(code: int) -> bool:
    """An encoder model's request: its prompt is computed in one step (no chunk, no hit)."""
    return code != NO_POOLING and bool(code & WHOLE_PROMPT)


def needs_every_position(code: int) -> bool:
    """MEAN and CLS read positions a prefix-cache hit would skip, and an encoder model's
    positions all see each other: such requests skip the prefix cache (a decoder's LAST reads
    only the last position, which is always computed)."""
    return code != NO_POOLING and (code & (_TYPE_MASK | WHOLE_PROMPT)) != LAST


def _first_architecture(hf_config) -> str | None:
    archs = hf_config.get("architectures") if isinstance(hf_config, dict) else None
    return archs[0] if archs and isinstance(archs, list) else None


def is_encoder(hf_config) -> bool:
    """config.json names an encoder model (no LM head, bidirectional attention)."""
    return _first_architecture(hf_config) in ENCODER_ARCHITECTURES


def is_classifier(hf_config) -> bool:
    """config.json names a sequence classification model (a score head, no LM head)."""
    return _first_architecture(hf_config) in ENCODER_CLASSIFIERS | DECODER_CLASSIFIERS


def parse_pooler_config(text: str | None, base: PoolerConfig) -> PoolerConfig:
    """`--pooler-config` JSON over `base` (the model's own); keys pooling_type and normalize
    (a classifier's logits are never normalised)."""
    if not text:
        return base
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise PoolerConfigError(f"--pooler-config: not JSON ({e}): {text!r}") from None
    if not isinstance(given, dict):
        raise PoolerConfigError(f"--pooler-config: expected a JSON object, got {text!r}")
    unknown = sorted(set(given) - {"pooling_type", "normalize"})
    if unknown:
        raise PoolerConfigError(f"--pooler-config: unknown key(s) {unknown}; "
                                "allowed: pooling_type, normalize")
    kind = given.get("pooling_type", base.pooling_type)
    if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
        raise PoolerConfigError(f"--pooler-config: pooling_type {kind!r}: expected one of "
                                f"{sorted(POOLING_TYPES)}")
    normalize = given.get("normalize", base.normalize)
    if not isinstance(normalize, bool):
        raise PoolerConfigError(f"--pooler-config: normalize {normalize!r}: expected true or "
                                "false")
    if normalize and base.classify:
        raise PoolerConfigError("--pooler-config: normalize true: a classification model's "
                                "output is its logits; expected false")
    return PoolerConfig(kind.upper(), normalize, base.whole_prompt, base.classify)


def read_config(model_dir: str | Path) -> dict:
    """config.json of a model directory ({} without one: a GGUF file)."""
    config_file = Path(model_dir) / "config.json"
    return _read_json(config_file) if config_file.is_file() else {}


def _pooling_only_architecture(model_dir: str | Path) -> tuple[str | None, dict]:
    """(config.json's architecture when it names a model without an LM head (an encoder or a
    classifier), else None; config.json). A GGUF file or a directory without config.json holds
    a decoder."""
    config = read_config(model_dir)
    pooling_only = is_encoder(config) or is_classifier(config)
    return (_first_architecture(config) if pooling_only else None), config


def check_runner(runner: str, model_dir: str | Path) -> None:
    """PoolerConfigError when `runner` is generate and the model has no LM head (an encoder, a
    classifier), as vLLM refuses it."""
    arch, config = _pooling_only_architecture(model_dir)
    if runner != "pooling" and arch is not None:
        kind = "a classification" if is_classifier(config) else "an encoder embedding"
        raise PoolerConfigError(f"runner={runner!r}: {arch} is {kind} model without an LM "
                                "head; it is served with --runner pooling only")


def model_pooler_config(model_dir: str | Path) -> PoolerConfig:
    """The directory's own pooling: a classifier's head (CLS for an encoder's, LAST for a
    decoder's; logits, never normalised); else its sentence-transformers files when it has
    them (a module we do not run, such as a Dense projection, is refused by name), else LAST +
    normalize (CLS + normalize for an encoder, as vLLM). An encoder's requests are
    WHOLE_PROMPT."""
    path = Path(model_dir)
    _, config = _pooling_only_architecture(path)
    encoder = is_encoder(config)
    if is_classifier(config):
        return PoolerConfig("CLS" if encoder else "LAST", False, encoder, classify=True)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig("CLS" if encoder else "LAST", True, encoder)
    modules = _read_json(modules_file)
    kinds = [m.get("type") for m in modules] if isinstance(modules, list) else None
    if not kinds or not all(isinstance(m, dict) for m in modules):
        raise PoolerConfigError(f"{modules_file}: expected a list of modules with a 'type'")
    others = [k for k in kinds if k not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)]
    if others:
        raise PoolerConfigError(f"{modules_file}: module(s) {others} are not supported; "
                                f"supported: {_ST_TRANSFORMER}, {_ST_POOLING}, {_ST_NORMALIZE}")
    kind = "CLS" if encoder else "LAST"
    if _ST_POOLING in kinds:
        folder = modules[kinds.index(_ST_POOLING)].get("path") or "1_Pooling"
        kind = _st_pooling_type(path / folder / "config.json")
    return PoolerConfig(kind, _ST_NORMALIZE in kinds, encoder)


def _st_pooling_type(config_file: Path) -> str:
    config = _read_json(config_file)
    chosen = [mode for flag, mode in _ST_MODES.items() if config.get(flag)]
    others = sorted(k for k, v in config.items()
                    if k.startswith("pooling_mode_") and v and k not in _ST_MODES)
    if others or len(chosen) != 1:
        raise PoolerConfigError(
            f"{config_file}: pooling modes {others + chosen or 'none'}: exactly one of "
            f"{sorted(_ST_MODES)} is supported")
    return chosen[0]


def _read_json(path: Path):
    if not path.is_file():
        raise PoolerConfigError(f"{path} is missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PoolerConfigError(f"{path}: not JSON ({e})") from None
