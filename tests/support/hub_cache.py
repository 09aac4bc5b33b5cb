"""A Hugging Face hub cache entry built on disk, laid out as huggingface_hub lays it out."""
from __future__ import annotations

import json
from pathlib import Path


def build_hub_cache(cache: Path, repo_id: str, model_dir: Path | None = None,
                    ref: str | None = "main") -> Path:
    """A hub cache entry: blobs, a snapshot of links to them, and refs/<ref> naming it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    files = sorted(p for p in model_dir.iterdir() if p.is_file()) if model_dir else []
    if not files:
        (snapshot / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    for i, src in enumerate(files):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(src.read_bytes())
        (snapshot / src.name).symlink_to(Path("../../blobs") / blob.name)
    if ref is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / ref).write_text(commit)
    return snapshot
