"""scheduler_service.api.scoring: which servers serve Classify and Score (FAILED_PRECONDITION
otherwise, naming why), a classifier's labels, a call's window within its key's places, its
requests' engine ids, and a bad head_dtype refused at start."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.pooling import PoolerConfig, model_pooler_config
from engine_common.text.tokenizer import Tokenizer
from engine_common.request.params import ParamError
from scheduler_service.api.api_keys import OPEN_POLICY as OPEN
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.front_door import FrontDoor, ServedModel
from scheduler_service.api.embeddings import served_pooler
from scheduler_service.core.admission import QueueFull
from scheduler_service.api.scoring import call_ids, call_window, classifier_of, classify, score
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
        asyncio.run(score(no_engine, door, "caller", "r", ["a", ""], ["b", ""], True, OPEN,
                          "caller"))


def test_the_call_window_leaves_the_places_the_key_holds(classifiers):
    """--max-requests-per-key 3 with 2 of the key's requests running: the call's window is 1
    (before: 3, so its second request failed RESOURCE_EXHAUSTED); never more than its inputs."""
    served = ServedModel(ModelInfo.from_dir(classifiers[1]),
                         Tokenizer.from_dir(classifiers[1]), block_size=16,
                         pooler=model_pooler_config(classifiers[1]), max_num_seqs=4)
    door = FrontDoor(served, ApiOptions(max_requests_per_key=3))
    assert call_window(door, "alice") == 3 and call_window(door, "alice", 2) == 2
    with door.quota.hold("alice", "g1", n=2):
        assert call_window(door, "alice") == 1
        assert call_window(door, "bob") == 3
        with door.quota.hold("alice", "g2"):
            assert call_window(door, "alice") == 1        # at least one: `hold` refuses it
    assert call_window(FrontDoor(served, ApiOptions()), "alice") == 4    # max_num_seqs


def test_a_calls_engine_ids_are_its_own():
    """A call's requests never take an id its caller can give (before: `<request_id>-<i>`,
    the same caller's Embed `x-0` clashed with Score `x`'s first pair)."""
    first, again = call_ids("score", "x"), call_ids("score", "x")
    assert first(0) != "x-0" and first(0).startswith("score-") and first(0).endswith("-x-0")
    assert first(0) != again(0) and first(0) != first(1)


def test_a_bad_head_dtype_is_refused_at_start(tmp_path):
    """Refused where the server reads its pooling (served_pooler), naming config.json's field,
    the value and the allowed values; before, only the worker failed, building the model."""
    model = str(make_classifier_model(tmp_path / "bert", "bert", 1, head_dtype="float8"))
    with pytest.raises(ParamError, match=r"config.json head_dtype='float8' is invalid: must "
                                         r"be \"model\" .* or one of float32, .*bfloat16"):
        served_pooler("pooling", None, model)


def test_a_classify_call_past_the_token_limit_is_refused_by_name(classifiers):
    served = ServedModel(ModelInfo.from_dir(classifiers[3]),
                         Tokenizer.from_dir(classifiers[3]), block_size=16,
                         pooler=model_pooler_config(classifiers[3]))
    door = FrontDoor(served, ApiOptions(max_score_tokens=20))
    texts = ["keys and values in a cache"] * 8
    no_engine = None          # refused before the engine is reached
    with pytest.raises(ParamError, match=r"input='2\d tokens in the first \d texts' is invalid: "
                                         r"must be at most 20 tokens .*--max-score-tokens"):
        asyncio.run(classify(no_engine, door, "caller", "r", texts, True, OPEN, "caller"))


def test_a_call_at_its_keys_bound_is_refused_at_once_as_a_generate_is(classifiers):
    """Before (session 45), a Classify or Score call's requests waited for places of the key
    while the key's Generate and Embed calls were refused at the bound, and a waiting call
    took each place as it came free, so the key's other calls were refused for as long as it
    ran. Now a call takes its places at once, before its texts are tokenized, or is refused
    RESOURCE_EXHAUSTED with a Generate's message (QueueFull); another key is not affected;
    nothing is left held."""
    served = ServedModel(ModelInfo.from_dir(classifiers[1]),
                         Tokenizer.from_dir(classifiers[1]), block_size=16,
                         pooler=model_pooler_config(classifiers[1]), max_num_seqs=4)
    door = FrontDoor(served, ApiOptions(max_requests_per_key=1))
    no_engine = None          # refused before the engine is reached

    async def run() -> None:
        with door.quota.hold("alice", "g"):
            for call in (score(no_engine, door, "alice", "s1", ["q"], ["d"], True, OPEN, "alice"),
                         classify(no_engine, door, "alice", "c1", ["t"], True, OPEN, "alice")):
                with pytest.raises(QueueFull, match=r"requests in flight for this API key=2 "
                                   r"must be <= 1 \(--max-requests-per-key\)"):
                    await asyncio.wait_for(call, 30)      # before: waited for the place
            assert door.quota.live("alice") == 1 and door.quota.live("bob") == 0
            # another key's call takes its place (and fails later, at the missing engine)
            with pytest.raises(AttributeError):
                await score(no_engine, door, "bob", "s2", ["q"], ["d"], True, OPEN, "bob")
        assert door.quota.live("alice") == door.quota.live("bob") == 0
    asyncio.run(run())
