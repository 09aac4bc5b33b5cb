"""A worker-like parent for the rank-orphan test: node 0 of a two-node group whose node 1 never
comes, so its rank waits in the rendezvous (for --dist-timeout). Prints the rank's pid, then
waits to be killed. Usage: python -m tests.support.rank_parent MODEL_DIR PORT"""
from __future__ import annotations

import logging
import sys
import threading

from worker_service.config import NodeLayout, RunnerConfig
from worker_service.ranks.rank_group import RankGroup, RankGroupOptions


def main(model_dir: str, port: str) -> None:
    logging.basicConfig(level=logging.INFO)      # the rank logs at this level: 'joining ...'
    layout = NodeLayout(tp_size=2, node_rank=0, num_nodes=2, num_local_ranks=1,
                        rendezvous_address=f"127.0.0.1:{port}", group_id="orphan-test")
    group = RankGroup("cpu", layout, RankGroupOptions(dist_timeout_s=600.0))
    config = RunnerConfig(model_dir=model_dir, max_model_len=64, block_size=4, max_num_seqs=4,
                          max_num_batched_tokens=64)
    spawned = threading.Event()
    group._respawn = _announce(group._respawn, spawned)    # noqa: SLF001 - test hook
    threading.Thread(target=group.load, args=(config, layout), daemon=True).start()
    spawned.wait()
    print(group.pids()[0], flush=True)
    threading.Event().wait()


def _announce(respawn, spawned: threading.Event):
    def wrapped(layout):
        respawn(layout)
        spawned.set()
    return wrapped


if __name__ == "__main__":
    main(*sys.argv[1:3])
