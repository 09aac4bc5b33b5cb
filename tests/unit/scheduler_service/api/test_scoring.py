"""scheduler_service.api.scoring: which servers serve Classify and Score (FAILED_PRECONDITION
otherwise, naming why), and a classifier's labels."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.pooling import PoolerConfig, model_pooler_config
from engine_common.text.tokenizer import Tokenizer
from engine_common.request.params import ParamError
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.front_door import FrontDoor, ServedModel
from scheduler_service.api.scoring import classifier_of, score
from scheduler_service.errors import WrongRunner
from tests.support.classifier_models import make_classifier_model


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    root = tmp_path_factory.mktemp("clf")
    return {n: str(make_classifier_model(root / f"bert{n}", "bert", n)) for n in (1, 3)}


def door(model_dir: str, pooler: PoolerConfig | None):
    served = ServedModel(ModelInfo.from_dir(model_dir), Tokenizer.from_dir(model_dir),
                         block_size=16, pooler=pooler)
    return SimpleNamespace(model=served)


@pytest.mark.parametrize("pooler, says", [
    (None, "Classify: this server's model generates; Classify needs a sequence classification"),
    (PoolerConfig("CLS", True, True), "model embeds; Classify needs"),
])
def test_non_classifier_servers_refuse(classifiers, pooler, says):
    with pytest.raises(WrongRunner, match=says):
        classifier_of(door(classifiers[3], pooler), "Classify")


def test_score_needs_one_label_classify_takes_any(classifiers):
    three = door(classifiers[3], model_pooler_config(classifiers[3]))
    assert classifier_of(three, "Classify").labels == ("class-0", "class-1", "class-2")
    with pytest.raises(WrongRunner, match="Score: this model has num_labels=3"):
        classifier_of(three, "Score")
    one = door(classifiers[1], model_pooler_config(classifiers[1]))
    assert classifier_of(one, "Score").num_labels == 1


def test_an_empty_pair_is_refused_naming_it(tmp_path):
    """A decoder's tokenizer adds no specials to a pair: two empty texts are no tokens. That is
    INVALID_ARGUMENT naming `pair[i]` before any engine is asked (was: an engine rejection
    naming `prompt_token_ids` of an internal request id)."""
    model = str(make_classifier_model(tmp_path / "qwen3", "qwen3", 1))
    served = ServedModel(ModelInfo.from_dir(model), Tokenizer.from_dir(model), block_size=16,
                         pooler=model_pooler_config(model))
    door = FrontDoor(served, ApiOptions())
    no_engine = None          # refused before the engine is reached
    with pytest.raises(ParamError, match=r"pair\[1\]='no tokens'"):
        asyncio.run(score(no_engine, door, "caller", "r", ["a", ""], ["b", ""], True, "",
                          "caller"))
