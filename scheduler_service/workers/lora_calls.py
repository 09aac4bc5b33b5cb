"""LoadLora / UnloadLora on every worker service of the replica (docs/lora.md, "Loading at run
time"): the LoRAOps of the gRPC engine. A refusal by any worker frees the slot on the others
again, so no worker keeps an adapter the scheduler does not serve."""
from __future__ import annotations

import logging

import grpc

from engine_common.configuration.lora import AdapterRefused
from engine_common.wire.protos import worker_pb2
from scheduler_service.errors import WorkerFailure
from scheduler_service.workers.worker_client import WorkerClient
from scheduler_service.workers.worker_stream import describe_rpc_error

log = logging.getLogger(__name__)

# A worker's refusal of the directory (or of the call: runtime updating off in its Init).
_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


class WorkerLoRA:
    """Slot changes on the workers `client` drives, between steps (the engine thread)."""

    def __init__(self, client: WorkerClient):
        self.client = client

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """Every worker holds adapter `name` from `path` in slot lora_id - 1, or none does:
        AdapterRefused naming the worker, the path and the reason; WorkerFailure when one
        did not answer (the engine then starts a new epoch)."""
        replies = self.client.call_owned("LoadLora", lambda epoch, owner: worker_pb2.
                                         LoadLoraRequest(epoch=epoch, scheduler_id=owner,
                                                         lora_id=lora_id, name=name, path=path))
        failed = [(addr, e) for addr, e in zip(self.client.addresses, replies)
                  if isinstance(e, grpc.RpcError)]
        if not failed:
            return
        if len(failed) < len(replies):
            try:
                self.unload_lora(lora_id)
            except WorkerFailure as err:    # harmless: no request names the slot, a load
                log.warning("freeing LoRA slot %d again failed: %s", lora_id, err)  # replaces it
        addr, e = failed[0]
        if all(err.code() in _REFUSALS for _, err in failed):
            raise AdapterRefused(f"worker {addr}: {e.details()}")
        raise WorkerFailure(f"worker {addr}: LoadLora failed: {describe_rpc_error(e)}")

    def unload_lora(self, lora_id: int) -> None:
        """Free slot lora_id - 1 on every worker; WorkerFailure when one failed."""
        replies = self.client.call_owned("UnloadLora", lambda epoch, owner: worker_pb2.
                                         UnloadLoraRequest(epoch=epoch, scheduler_id=owner,
                                                           lora_id=lora_id))
        for addr, e in zip(self.client.addresses, replies):
            if isinstance(e, grpc.RpcError):
                raise WorkerFailure(f"worker {addr}: UnloadLora failed: "
                                    f"{describe_rpc_error(e)}")
