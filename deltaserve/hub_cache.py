"""`--model org/name`: a Hugging Face Hub id, found in the local hub cache as huggingface_hub lays
it out (nothing of huggingface_hub is imported to read it):

    $HF_HUB_CACHE  (else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/...)
    └── models--org--name/
        ├── refs/main                 the commit hash the "main" revision points at
        └── snapshots/<commit hash>/  config.json, tokenizer.json, *.safetensors (links to blobs)

A value is taken as a hub id only when it is not an existing path and looks like one
(`org/name`, one slash). When it is not cached, it is downloaded with huggingface_hub where that
is installed and HF_HUB_OFFLINE is not set; otherwise (or when the download fails) the error
names the command that fetches it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_REVISION = "main"
# What serving reads; the download skips the rest (other formats, images, ...).
_ALLOW = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class HubModelError(OSError):
    """A hub id that is neither cached nor downloadable; the message says how to get it."""


def hub_cache_dir() -> Path:
    """The hub cache directory, as huggingface_hub finds it."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = str(Path(base) / "huggingface")
    return Path(home).expanduser() / "hub"


def is_hub_id(model: str) -> bool:
    return not Path(model).exists() and _HUB_ID.fullmatch(model) is not None


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The cached snapshot of `repo_id` at "main" (refs/main), or its only snapshot when no ref
    is recorded; None when it is not cached (or holds no config.json)."""
    repo = (cache or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / _REVISION
    snapshots = repo / "snapshots"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
    else:
        found = sorted(snapshots.iterdir()) if snapshots.is_dir() else []
        candidate = found[0] if len(found) == 1 else None
    if candidate is None or not (candidate / "config.json").is_file():
        return None
    return candidate


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub_model(repo_id: str) -> Path:
    """The local directory of a hub id: cached, else downloaded (see the module docstring)."""
    cache = hub_cache_dir()
    found = cached_snapshot(repo_id, cache)
    if found is not None:
        return found
    how = (f"download it with `hf download {repo_id}` (or `huggingface-cli download "
           f"{repo_id}`), or pass --model a local model directory")
    if offline():
        raise HubModelError(f"model {repo_id!r} is not in the Hugging Face cache ({cache}) and "
                            f"HF_HUB_OFFLINE is set: {how}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HubModelError(f"model {repo_id!r} is not in the Hugging Face cache ({cache}) and "
                            f"huggingface_hub is not installed to fetch it: {how}") from None
    print(f"downloading {repo_id} into {cache} (huggingface_hub)...", flush=True)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_ALLOW, cache_dir=cache))
    except Exception as e:   # network, auth, unknown repo: one line, with the way out
        raise HubModelError(f"model {repo_id!r} could not be downloaded ({type(e).__name__}: "
                            f"{str(e)[:200]}): {how}") from None


def resolve_model_arg(args) -> str:
    """--model as a local path: a hub id resolved (its id becomes the served name unless
    --served-model-name is given, as in vLLM); anything else as given."""
    if args.model is None or not is_hub_id(args.model):
        return args.model
    if not getattr(args, "served_model_name", None):
        args.served_model_name = args.model
    return str(resolve_hub_model(args.model))
