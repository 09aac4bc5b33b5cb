"""scheduler_service.api.scoring: which servers serve Classify and Score (FAILED_PRECONDITION
otherwise, naming why), and a classifier's labels."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.pooling import PoolerConfig, model_pooler_config
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.api.front_door import ServedModel
from scheduler_service.api.scoring import classifier_of
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
