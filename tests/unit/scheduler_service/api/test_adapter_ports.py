"""--lora-engine-listen (scheduler_service/api/adapter_ports.py): NAME=HOST:PORT entries, each
refused naming the flag's field and the entry; a server started without --enable-lora refuses
it. The ports themselves run against the real gateway in tests/e2e/test_gateway_lora.py."""
from __future__ import annotations

import pytest

from engine_common.configuration.config import WorkerConfig
from engine_common.request.params import ParamError
from scheduler_service.api.adapter_ports import adapter_listen_of, parse_adapter_listen
from scheduler_service.api.server import ServerOptions, build_scheduler_server


def test_entries():
    assert parse_adapter_listen(None) == ()
    assert parse_adapter_listen(" sql=127.0.0.1:9001\tchat=[::1]:0 ") == (
        ("sql", "127.0.0.1:9001"), ("chat", "[::1]:0"))


@pytest.mark.parametrize("text, says", [
    ("sql", "NAME=HOST:PORT entries"),
    ("sql=127.0.0.1", "NAME=HOST:PORT entries"),
    ("sql=127.0.0.1:70000", "NAME=HOST:PORT entries"),
    ("sql=off", "NAME=HOST:PORT entries"),
    ("=127.0.0.1:1", "an adapter name of 1 to 256 printable characters"),
    ("a=127.0.0.1:1 a=127.0.0.1:2", "unique adapter names and addresses"),
    ("a=127.0.0.1:1 b=127.0.0.1:1", "unique adapter names and addresses"),
])
def test_bad_entries_are_named(text, says):
    with pytest.raises(ParamError, match="lora_engine_listen=.* is invalid: must be") as err:
        parse_adapter_listen(text)
    assert says in str(err.value)


def test_a_name_that_can_never_be_served_is_refused(tmp_path):
    fixed = WorkerConfig(model_dir=str(tmp_path), enable_lora=True, lora_modules="sql=/a")
    assert adapter_listen_of("sql=127.0.0.1:0", fixed) == (("sql", "127.0.0.1:0"),)
    with pytest.raises(ParamError, match=r"lora_engine_listen='chat' is invalid: must be an "
                                         r"adapter of --lora-modules \['sql'\]"):
        adapter_listen_of("chat=127.0.0.1:0", fixed)
    loadable = WorkerConfig(model_dir=str(tmp_path), enable_lora=True,
                            allow_runtime_lora_updating=True)
    assert adapter_listen_of("chat=127.0.0.1:0", loadable) == (("chat", "127.0.0.1:0"),)


def test_needs_enable_lora(tiny_models):
    with pytest.raises(ParamError, match="enable_lora=False is invalid: must be true with "
                                         "--lora-engine-listen"):
        build_scheduler_server(["127.0.0.1:1"], "127.0.0.1:0",
                               WorkerConfig(model_dir=tiny_models("llama")),
                               options=ServerOptions(lora_engine_listen="sql=127.0.0.1:0"))


@pytest.mark.parametrize("served", ["sql", None])
def test_an_adapter_with_the_models_served_name_is_refused(tiny_models, served):
    """The gateway routes by name: an adapter port registering the model's own name would be
    one model's second worker, and some of the model's requests would run the adapter."""
    model = tiny_models("llama")
    name = served or model.rstrip("/").rsplit("/", 1)[-1]
    worker = WorkerConfig(model_dir=model, enable_lora=True, lora_modules=f"{name}=/a")
    with pytest.raises(ParamError, match=f"lora_engine_listen='{name}' is invalid: must be an "
                                         "adapter name other than the model's served name"):
        build_scheduler_server(["127.0.0.1:1"], "127.0.0.1:0", worker,
                               options=ServerOptions(lora_engine_listen=f"{name}=127.0.0.1:0",
                                                     served_model_name=served))
