"""The served LoRA adapters (scheduler_service/core/lora_registry.py): ids of --lora-modules
first, a runtime load takes the lowest id neither served, draining nor in use, every load a new
generation; unknown and duplicate names are refused naming the field and the value."""
from __future__ import annotations

import pytest

from engine_common.configuration.lora import (AdapterExists, AdapterNotFound,
                                              parse_lora_modules)
from engine_common.request.params import ParamError
from scheduler_service.core.lora_registry import LoRARegistry


def test_ids_generations_and_draining():
    reg = LoRARegistry(parse_lora_modules("a=/a b=/b"))
    assert reg.resolve("a") == (1, 1) and reg.resolve("b") == (2, 2)
    assert reg.resolve(None) == (0, 0)
    c = reg.reserve("c", "/c", ids_in_use=set())
    assert (c.lora_id, c.generation) == (3, 3)
    with pytest.raises(AdapterNotFound):       # reserved, not served until added
        reg.resolve("c")
    reg.add(c)
    assert reg.remove("a").lora_id == 1
    assert reg.draining() == {1} and not reg.is_live(1, 1) and reg.is_live(2, 2)
    # id 1 drains: a load takes 4; once freed (and unused) a load takes 1, new generation
    assert reg.reserve("d", "/d", set()).lora_id == 4
    reg.freed(1)
    assert reg.reserve("e", "/e", ids_in_use={1}).lora_id == 4
    again = reg.reserve("a", "/other", set())
    assert (again.lora_id, again.generation) == (1, 6)
    reg.add(again)
    assert reg.resolve("a") == (1, 6) and not reg.is_live(1, 1)
    assert [(x.name, x.static) for x in reg.adapters()] == [("a", False), ("b", True),
                                                            ("c", False)]


def test_refusals_name_the_field_and_value():
    reg = LoRARegistry(parse_lora_modules("a=/a"))
    with pytest.raises(AdapterExists, match=r"lora_name='a' is invalid: must be a name no "
                                            r"served adapter has"):
        reg.reserve("a", "/x", set())
    with pytest.raises(AdapterNotFound, match=r"lora_name='z' is invalid: must be a served "
                                              r"LoRA adapter: \['a'\]"):
        reg.remove("z")
    with pytest.raises(AdapterNotFound, match=r"lora_name='z' is invalid"):
        reg.resolve("z", "lora_name")
    with pytest.raises(ParamError, match=r"lora_name='a\\tb' is invalid: must be 1 to 256 "):
        reg.reserve("a\tb", "/x", set())
    with pytest.raises(ParamError, match=r"lora_path='' is invalid"):
        reg.reserve("new", "", set())


def test_ids_are_bounded(monkeypatch):
    from scheduler_service.core import lora_registry

    monkeypatch.setattr(lora_registry, "MAX_LORA_ID", 2)
    reg = LoRARegistry(parse_lora_modules("a=/a"))
    reg.add(reg.reserve("b", "/b", set()))
    with pytest.raises(ParamError, match=r"lora_name='c' is invalid: must be room for it: 2 "
                                         r"adapter ids are served, draining or in use"):
        reg.reserve("c", "/c", set())
