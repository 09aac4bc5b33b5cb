"""`--model org/name` from a Hugging Face hub cache laid out as huggingface_hub lays it out
(built here: no network): HF_HUB_CACHE / HF_HOME / XDG_CACHE_HOME, refs/main and snapshots;
a missing id with HF_HUB_OFFLINE names the download command."""
from __future__ import annotations

import argparse
import pytest

from deltaserve.hub_cache import (HubModelError, cached_snapshot, hub_cache_dir, is_hub_id,
                                  resolve_hub_model, resolve_model_arg)
from tests.support.hub_cache import build_hub_cache

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return monkeypatch


def test_the_cache_directory_follows_huggingface_hubs_variables(hub_env, tmp_path):
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    hub_env.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert hub_cache_dir() == tmp_path / "direct"


def test_a_cached_id_resolves_to_its_main_snapshot(hub_env, tmp_path):
    hub_env.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = build_hub_cache(tmp_path / "home" / "hub", REPO_ID)
    assert resolve_hub_model(REPO_ID) == snapshot
    other = build_hub_cache(tmp_path / "home" / "hub", "org/no-ref", ref=None)
    assert cached_snapshot("org/no-ref") == other      # the only snapshot
    assert cached_snapshot("org/absent") is None


def test_only_what_is_not_a_path_and_looks_like_an_id_is_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id(REPO_ID) and not is_hub_id("model") and not is_hub_id("/a/b")
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not is_hub_id("org/local")                  # an existing relative path wins


def test_a_missing_id_offline_names_the_download_command(hub_env):
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubModelError, match=f"hf download {REPO_ID}"):
        resolve_hub_model(REPO_ID)


def test_the_id_becomes_the_served_name_unless_one_is_given(hub_env, tmp_path):
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    snapshot = build_hub_cache(tmp_path / "c", REPO_ID)
    args = argparse.Namespace(model=REPO_ID)
    assert resolve_model_arg(args) == str(snapshot) and args.served_model_name == REPO_ID
    args = argparse.Namespace(model=REPO_ID, served_model_name="mine")
    assert resolve_model_arg(args) == str(snapshot) and args.served_model_name == "mine"
    assert resolve_model_arg(argparse.Namespace(model=None)) is None
