"""Defaults by device: CUDA gets async scheduling, a 16384-token budget and fused ops; every
other device keeps the declared defaults; `serve` decides without importing torch."""
from __future__ import annotations

import dataclasses

from engine_common.configuration.config import SchedulerConfig, WorkerConfig
from engine_common.configuration.device_defaults import CUDA_DEFAULTS, device_defaults


def test_cuda_devices_get_the_cuda_defaults_and_others_none():
    assert device_defaults("cuda") == CUDA_DEFAULTS
    assert device_defaults("cuda:3") == CUDA_DEFAULTS
    assert device_defaults("cpu") == {}


def test_every_cuda_default_is_a_declared_setting_that_it_changes():
    fields = {f.name: f.default for cls in (SchedulerConfig, WorkerConfig)
              for f in dataclasses.fields(cls)}
    for name, value in CUDA_DEFAULTS.items():
        assert name in fields and fields[name] != value, name
    SchedulerConfig(**{k: v for k, v in CUDA_DEFAULTS.items() if k in
                       {f.name for f in dataclasses.fields(SchedulerConfig)}})


def test_serve_reads_the_worker_device_without_torch(tmp_path, monkeypatch):
    from deltaserve import embedded

    assert embedded._worker_device("cpu") == "cpu"
    assert embedded._worker_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(embedded, "Path", lambda p: tmp_path / "nvidiactl")
    assert embedded._worker_device("auto") == "cpu"
    (tmp_path / "nvidiactl").touch()
    assert embedded._worker_device("auto") == "cuda"


def test_speculative_decoding_keeps_async_scheduling_on_cuda():
    """Speculative decoding runs with async scheduling: the CUDA default stays on."""
    assert device_defaults("cuda")["async_scheduling"] is True
    config = SchedulerConfig(max_model_len=64, speculative_config='{"method": "ngram", '
                             '"num_speculative_tokens": 2}',
                             async_scheduling=device_defaults("cuda")["async_scheduling"])
    assert config.async_scheduling and config.speculative.num_speculative_tokens == 2
