"""engine_common.request.pooling: the pooler configuration from --pooler-config and from a
sentence-transformers directory, and its wire code."""
from __future__ import annotations

import json

import pytest

from engine_common.request.pooling import (CLS, DECODER_CLASSIFIERS, ENCODER_ARCHITECTURES,
                                           ENCODER_CLASSIFIERS, LAST, MEAN, NORMALIZE,
                                           PAIR_SHIFT, PoolerConfig, PoolerConfigError,
                                           check_runner, decode_code, is_classify,
                                           model_pooler_config, needs_every_position,
                                           is_whole_prompt, pair_start, parse_pooler_config,
                                           with_pair_start)

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORM = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def test_codes_round_trip_and_say_what_skips_the_prefix_cache():
    for kind, index in (("LAST", LAST), ("MEAN", MEAN), ("CLS", CLS)):
        for normalize in (False, True):
            for whole in (False, True):      # an encoder's request: never a prefix hit
                config = PoolerConfig(kind, normalize, whole)
                assert decode_code(config.code) == (index, normalize)
                assert is_whole_prompt(config.code) == whole
                assert needs_every_position(config.code) == (kind != "LAST" or whole)
    assert PoolerConfig().code == LAST | NORMALIZE
    assert not needs_every_position(-1) and not is_whole_prompt(-1)
    for bad in (-2, 3, 7, 11, 15, 19, 3 | 1 << PAIR_SHIFT):
        with pytest.raises(ValueError, match=f"pooling code {bad}"):
            decode_code(bad)


@pytest.mark.parametrize("text, expected", [
    (None, PoolerConfig("LAST", True)),
    ('{"pooling_type": "mean"}', PoolerConfig("MEAN", True)),
    ('{"normalize": false}', PoolerConfig("LAST", False)),
    ('{"pooling_type": "CLS", "normalize": true}', PoolerConfig("CLS", True)),
])
def test_pooler_config_flag_overrides_the_model(text, expected):
    assert parse_pooler_config(text, PoolerConfig()) == expected


@pytest.mark.parametrize("text, says", [
    ("{", "not JSON"),
    ("[1]", "expected a JSON object"),
    ('{"pooling": "MEAN"}', "unknown key(s) ['pooling']"),
    ('{"pooling_type": "ALL"}', "pooling_type 'ALL': expected one of"),
    ('{"normalize": "yes"}', "normalize 'yes': expected true or false"),
])
def test_bad_pooler_config_flags_name_the_problem(text, says):
    with pytest.raises(PoolerConfigError) as err:
        parse_pooler_config(text, PoolerConfig())
    assert says in str(err.value)


def _model_dir(tmp_path, arch: str = "Qwen3ForCausalLM"):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return tmp_path


def _st_dir(tmp_path, modules, pooling: dict | None = None, arch: str = "Qwen3ForCausalLM"):
    _model_dir(tmp_path, arch)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_model_directory_pooling(tmp_path):
    assert model_pooler_config(_model_dir(tmp_path)) == PoolerConfig("LAST", True)  # no ST
    last = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}
    d = _st_dir(tmp_path, [TRANSFORMER, POOLING, NORM], last)
    assert model_pooler_config(d) == PoolerConfig("LAST", True)
    (d / "modules.json").write_text(json.dumps([TRANSFORMER, POOLING]))
    assert model_pooler_config(d) == PoolerConfig("LAST", False)


@pytest.mark.parametrize("pooling, says", [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "exactly one of"),
    ({"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    ({}, "none"),
])
def test_unsupported_sentence_transformers_pooling_is_refused(tmp_path, pooling, says):
    with pytest.raises(PoolerConfigError, match=says):
        model_pooler_config(_st_dir(tmp_path, [TRANSFORMER, POOLING], pooling))


def test_missing_or_broken_sentence_transformers_files_are_refused(tmp_path):
    with pytest.raises(PoolerConfigError, match="1_Pooling/config.json is missing"):
        model_pooler_config(_st_dir(tmp_path, [TRANSFORMER, POOLING]))
    (tmp_path / "modules.json").write_text("{")
    with pytest.raises(PoolerConfigError, match="modules.json: not JSON"):
        model_pooler_config(tmp_path)
    (tmp_path / "modules.json").write_text('{"a": 1}')
    with pytest.raises(PoolerConfigError, match="expected a list of modules"):
        model_pooler_config(tmp_path)


@pytest.mark.parametrize("arch", sorted(ENCODER_ARCHITECTURES - ENCODER_CLASSIFIERS))
def test_an_encoder_pools_whole_prompts_by_cls_unless_its_files_say(tmp_path, arch):
    """vLLM's BertEmbeddingModel default: CLS, normalised; every request WHOLE_PROMPT, also
    under --pooler-config; --runner generate refused (no LM head)."""
    assert model_pooler_config(_model_dir(tmp_path, arch)) == PoolerConfig("CLS", True, True)
    mean = {"pooling_mode_mean_tokens": True}
    d = _st_dir(tmp_path, [TRANSFORMER, POOLING], mean, arch)
    assert model_pooler_config(d) == PoolerConfig("MEAN", False, True)
    flag = parse_pooler_config('{"pooling_type": "LAST"}', model_pooler_config(d))
    assert flag == PoolerConfig("LAST", False, True) and is_whole_prompt(flag.code)
    check_runner("pooling", d)
    with pytest.raises(PoolerConfigError, match=f"{arch} is an encoder.*--runner pooling"):
        check_runner("generate", d)
    check_runner("generate", _model_dir(tmp_path))        # a decoder generates


@pytest.mark.parametrize("arch", sorted(ENCODER_CLASSIFIERS | DECODER_CLASSIFIERS))
def test_a_classifier_pools_its_heads_row_into_logits(tmp_path, arch):
    """CLS for an encoder's head, LAST for a decoder's; never normalised (refused under
    --pooler-config); --runner generate refused; a decoder's LAST still takes prefix hits."""
    encoder = arch in ENCODER_CLASSIFIERS
    config = model_pooler_config(_model_dir(tmp_path, arch))
    assert config == PoolerConfig("CLS" if encoder else "LAST", False, encoder, classify=True)
    assert is_classify(config.code) and needs_every_position(config.code) == encoder
    assert decode_code(config.code) == (CLS if encoder else LAST, False)
    with pytest.raises(PoolerConfigError, match="normalize true.*expected false"):
        parse_pooler_config('{"normalize": true}', config)
    assert parse_pooler_config('{"pooling_type": "MEAN"}', config).classify
    with pytest.raises(PoolerConfigError, match=f"{arch} is a classification.*--runner pooling"):
        check_runner("generate", tmp_path)


def test_a_pair_start_rides_on_the_code_without_changing_the_rest():
    code = PoolerConfig("CLS", False, True, classify=True).code
    paired = with_pair_start(code, 7)
    assert pair_start(paired) == 7 and pair_start(code) == 0 and pair_start(-1) == 0
    assert decode_code(paired) == decode_code(code) and is_classify(paired)
    assert is_whole_prompt(paired) and needs_every_position(paired)
    assert not is_classify(-1) and not is_classify(PoolerConfig().code)
