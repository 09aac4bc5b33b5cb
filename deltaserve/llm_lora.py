"""LLM.load_lora / unload_lora / lora_adapters: LoRA adapters loaded at run time offline
(docs/lora.md, "Loading at run time"), as the server's LoadLoraAdapter and UnloadLoraAdapter.

LLM calls run one at a time and generate() returns with no request left, so a load or an
unload here happens between calls, with nothing in flight.
"""
from __future__ import annotations

from engine_common.configuration.lora import AdapterRefused
from scheduler_service.core.lora_registry import LoRARegistry, ServedAdapter
from scheduler_service.engine.lora_updates import LoRAUpdates, lora_cache, lora_capacity
from worker_service.lora.adapter import LoRAError
from worker_service.lora.load import runtime_slots


class RunnerLoRA:
    """LoRAOps on the in-process model runner."""

    def __init__(self, runner):
        self.runner = runner

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        try:
            runtime_slots(self.runner.lora, self.runner.config, "LoadLora").load(lora_id, name,
                                                                                 path)
        except LoRAError as e:
            raise AdapterRefused(str(e)) from None

    def unload_lora(self, lora_id: int) -> None:
        runtime_slots(self.runner.lora, self.runner.config, "UnloadLora").unload(lora_id)


def lora_updates(runner, config) -> LoRAUpdates:
    """The LLM's runtime loads: the adapters of config.lora_modules, the flag of config, the
    LRU of lora_capacity (None, without runtime updating or max_cpu_loras: every adapter
    stays loaded)."""
    registry = LoRARegistry(config.lora)
    return LoRAUpdates(registry, RunnerLoRA(runner), config.allow_runtime_lora_updating,
                       lora_cache(registry, lora_capacity(config)))


class LoRAMixin:
    """LLM methods over self._lora (LoRAUpdates) and self.engine."""

    def load_lora(self, name: str, path: str) -> int:
        """Load the PEFT directory `path` as adapter `name` (vLLM's load_lora_adapter; needs
        enable_lora=True, allow_runtime_lora_updating=True): generate(lora_request=name) uses
        it from now on. Returns its id. AdapterExists for a served name, AdapterRefused naming
        the path and the reason for a directory that cannot be served (nothing changes)."""
        with self._exclusive("load_lora"):
            return self._lora.load(self._in_use(), lambda: None, name, path,
                                   self.engine.core.scheduler.lora_ids_running).lora_id

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` and free it (vLLM's unload_lora_adapter); a request
        naming it then raises AdapterNotFound, as does unloading an unknown name."""
        with self._exclusive("unload_lora"):
            self._lora.unload(self._in_use(), lambda: None, name)

    def lora_adapters(self) -> list[ServedAdapter]:
        """The adapters generate() may name now."""
        return self._lora.registry.adapters()

    def _in_use(self) -> set[int]:
        return self.engine.core.scheduler.lora_ids_in_use()
