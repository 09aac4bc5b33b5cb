"""vLLM's list-valued flags on `serve` and `scheduler`: --served-model-name NAME [ALIAS ...]
and --api-key KEY [KEY ...] reach the gateway's command line (smg --model-alias,
--tenant-api-key), the first name reaches the scheduler, and what smg cannot carry is refused
with the flag named. tests/integration/test_served_names_and_keys_gateway.py runs them on
the real gateway."""
from __future__ import annotations

import pytest

from deltaserve.cli import build_parser, main
from deltaserve.openai_gateway import openai_front, openai_options, smg_command
from deltaserve.vllm_lists import swallowed_model
from engine_common.request.params import ParamError
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.engine_flags import engine_settings


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def _pairs(cmd: list[str], flag: str) -> list[str]:
    """The values of `flag` in `cmd`, given as `flag VALUE` or `flag=VALUE`."""
    return [cmd[i + 1] if arg == flag else arg.partition("=")[2]
            for i, arg in enumerate(cmd) if arg == flag or arg.startswith(flag + "=")]


@pytest.mark.parametrize("command", [["serve"], ["scheduler", "--model", "m", "--workers",
                                                 "h:1", "--port", "8001"]])
def test_several_served_names_become_the_models_name_and_the_gateways_aliases(command):
    args = _args(*command, "--served-model-name", "alpha", "beta", "gamma", "beta")
    options, _ = openai_options(args)
    assert (options.served_model_name, options.model_aliases) == ("alpha", ("beta", "gamma"))
    assert engine_settings(args, "m").server.served_model_name == "alpha"
    cmd = smg_command("smg", options, "127.0.0.1:1", "m", 2)
    assert _pairs(cmd, "--model-alias") == ["beta=alpha", "gamma=alpha"]


def test_one_served_name_gives_the_gateway_no_alias():
    options, _ = openai_options(_args("serve", "--served-model-name", "alpha"))
    assert options.model_aliases == ()
    assert _pairs(smg_command("smg", options, "127.0.0.1:1", "m", 2), "--model-alias") == []


def test_several_api_keys_are_the_gateways_key_and_its_tenant_keys():
    options, _ = openai_options(_args("serve", "--api-key", "k1", "k:2", "k3", "k1"))
    assert options.api_keys == ("k1", "k:2", "k3") and options.api_key == "k1"
    cmd = smg_command("smg", options, "127.0.0.1:1", "m", 2)
    assert _pairs(cmd, "--api-key") == ["k1"]
    assert _pairs(cmd, "--tenant-api-key") == ["key-2:k:2", "key-3:k3"]


@pytest.mark.parametrize("flags,message", [
    (["--api-key", "k1", " "], "--api-key=' ' is invalid: must be a key with a character"),
    (["--served-model-name", "alpha", "b=c"], "--served-model-name='b=c' is invalid: must be "
     "an alias without '='"),
    (["--served-model-name", "alpha", ""], "--served-model-name='' is invalid: must be a "
     "name with a character"),
])
def test_what_the_gateway_cannot_carry_is_refused_naming_the_flag(flags, message):
    with pytest.raises(ParamError) as caught:
        openai_options(_args("serve", *flags))
    assert str(caught.value).startswith(message), str(caught.value)


def test_aliases_without_the_openai_api_are_refused_not_dropped():
    args = _args("serve", "--openai-listen", "off", "--served-model-name", "alpha", "beta")
    with pytest.raises(ParamError, match="served-model-name.*one name without the OpenAI API"):
        openai_front(args, ApiOptions(), "m", "localhost:1")
    args = _args("serve", "--openai-listen", "off", "--served-model-name", "alpha")
    assert openai_front(args, ApiOptions(), "m", "localhost:1") is None


def test_the_cli_refuses_an_alias_in_one_line_before_the_model_is_read(capsys, tmp_path):
    code = main(["serve", "--model", str(tmp_path / "absent"), "--openai-listen", "off",
                 "--served-model-name", "alpha", "beta"])
    err = capsys.readouterr().err
    assert code == 2 and "--served-model-name" in err and "one name without" in err, err


@pytest.mark.parametrize("flag", ["--api-key", "--served-model-name"])
def test_a_model_after_a_list_flag_is_refused_not_taken_as_a_value(flag, capsys, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    code = main(["serve", "--openai-listen", "off", flag, "k1", str(model)])
    err = capsys.readouterr().err
    assert code == 2 and f"it was read as a value of {flag}" in err, err


def test_vllm_api_key_in_the_environment_guards_the_api_as_in_vllm():
    """vLLM serves with VLLM_API_KEY's key when --api-key is absent: the same line here must
    not serve the API open."""
    options, _ = openai_options(_args("serve"), environ={"VLLM_API_KEY": "env-key"})
    assert options.api_keys == ("env-key",)
    assert _pairs(smg_command("smg", options, "127.0.0.1:1", "m", 2), "--api-key") == ["env-key"]


@pytest.mark.parametrize("environ,keys", [({"VLLM_API_KEY": ""}, ()), ({}, ())])
def test_an_empty_or_absent_vllm_api_key_is_no_key(environ, keys):
    assert openai_options(_args("serve"), environ=environ)[0].api_keys == keys


def test_a_blank_vllm_api_key_is_refused_naming_the_variable():
    with pytest.raises(ParamError, match=r"VLLM_API_KEY=' ' is invalid: must be a key"):
        openai_options(_args("serve"), environ={"VLLM_API_KEY": " "})


def test_the_api_key_flag_wins_over_vllm_api_key():
    options, _ = openai_options(_args("serve", "--api-key", "flag-key"),
                                environ={"VLLM_API_KEY": "env-key"})
    assert options.api_keys == ("flag-key",)


@pytest.mark.parametrize("names", [["sql"], ["base", "sql"]])
def test_a_served_name_or_alias_that_is_an_adapter_name_is_refused(names):
    """A name both the model and a --lora-engine-listen adapter register: the gateway would
    answer it from either, so it is refused before the model is read."""
    args = _args("serve", "--served-model-name", *names, "--enable-lora",
                 "--lora-engine-listen", "chat=127.0.0.1:0 sql=127.0.0.1:0")
    with pytest.raises(ParamError, match="--served-model-name='sql' is invalid: must be a "
                                         "name no --lora-engine-listen adapter has"):
        openai_options(args)


def test_a_key_starting_with_a_dash_reaches_the_gateway_as_one_flag_value_word(tmp_path):
    """`--api-key=-k1` (secrets.token_urlsafe starts one key in 64 with '-'): smg's parser
    takes a separate word starting with '-' for a flag (`smg launch --api-key -abc` prints its
    usage and exits), so each key travels as `--flag=value`."""
    options, _ = openai_options(_args("serve", "--api-key=-k1"))
    cmd = smg_command("smg", options, "127.0.0.1:1", str(tmp_path), 2)
    assert "--api-key=-k1" in cmd and "-k1" not in cmd


def test_a_hub_id_after_served_model_name_is_refused_not_served_as_an_alias(capsys):
    """`serve --served-model-name my Qwen/Qwen3-0.6B`: vLLM refuses a served name without MODEL
    first; here it would serve the default model, with the Hub id as an alias."""
    code = main(["serve", "--served-model-name", "my", "Qwen/Qwen3-0.6B"])
    err = capsys.readouterr().err
    assert code == 2 and "MODEL='Qwen/Qwen3-0.6B' is invalid: it was read as a value of " \
                         "--served-model-name" in err, err


def test_a_cached_hub_id_after_api_key_is_refused_not_taken_as_a_key(capsys, tmp_path,
                                                                      monkeypatch):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    code = main(["serve", "--api-key", "k1", "org/tiny"])
    err = capsys.readouterr().err
    assert code == 2 and "MODEL='org/tiny' is invalid: it was read as a value of --api-key" \
        in err, err
    assert swallowed_model(_args("serve", "--api-key", "k1", "k/2")) is None  # not cached: a key
