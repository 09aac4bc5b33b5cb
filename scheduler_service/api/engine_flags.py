"""The engine flags of `deltaserve scheduler` and `deltaserve serve`, derived from the settings'
declarations (engine_common/configuration/settings.py): SchedulerConfig, WorkerConfig, ServerOptions and
ApiOptions (the public port's TLS, API keys and request limits)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine_common.configuration.config import SchedulerConfig, WorkerConfig
from engine_common.configuration.settings import add_flags, from_args
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.server import ServerOptions


@dataclass(frozen=True)
class EngineSettings:
    """Everything the engine flags set, split by who reads it."""

    worker: WorkerConfig
    policy: SchedulerConfig
    server: ServerOptions
    api: ApiOptions


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    add_flags(parser.add_argument_group("engine"), SchedulerConfig, WorkerConfig, ServerOptions,
              skip=skip)
    add_flags(parser.add_argument_group("public API: TLS, API keys, limits"), ApiOptions,
              skip=skip)


def engine_settings(args: argparse.Namespace, model_dir: str) -> EngineSettings:
    """The settings from parsed flags (ParamError names a bad value)."""
    return EngineSettings(worker=from_args(WorkerConfig, args, model_dir=model_dir),
                          policy=from_args(SchedulerConfig, args),
                          server=from_args(ServerOptions, args),
                          api=from_args(ApiOptions, args))
