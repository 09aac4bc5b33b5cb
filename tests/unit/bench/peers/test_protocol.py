"""bench/peers/protocol.py: the reply prefix and the process group's CPU clock."""
from __future__ import annotations

import json
import subprocess
import sys

from bench.peers.protocol import PREFIX, group_cpu_seconds
from tests.support.paths import REPO


def test_group_cpu_seconds_counts_this_process():
    before = group_cpu_seconds()
    sum(i * i for i in range(2_000_000))
    assert group_cpu_seconds() > before


def test_an_engine_process_replies_only_on_its_prefixed_lines():
    code = ("from bench.peers.protocol import serve\n"
            "print('chatter on stdout')\n"
            "def start():\n    print('library noise'); return object(), 'fake engine'\n"
            "def run(engine, tag):\n    return 0.5, [[1, 2]], {'tag_seen': tag}\n"
            "raise SystemExit(serve('fake', start, run))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True,
                          input='{"cmd": "run", "tag": "r0"}\n{"cmd": "quit"}\n',
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    replies = [json.loads(line[len(PREFIX):]) for line in done.stdout.splitlines()
               if line.startswith(PREFIX)]
    assert [r["event"] for r in replies] == ["ready", "result"]
    assert replies[0]["engine"] == "fake engine"
    assert replies[1]["token_ids"] == [[1, 2]] and replies[1]["tag_seen"] == "r0"
    assert replies[1]["cpu_s"] >= 0 and "library noise" in done.stderr
    assert "chatter on stdout" in done.stdout      # printed before the redirect: not a reply


class SimulatedGroup:
    """A process group's CPU clock and the wall clock, simulated: sleep() advances the wall
    clock, and the group uses `busy_share` of a core until `busy_until`, then nothing."""

    def __init__(self, busy_share: float, busy_until: float):
        self.now = self.cpu = 0.0
        self.busy_share, self.busy_until = busy_share, busy_until

    def sleep(self, seconds: float) -> None:
        busy = max(0.0, min(self.now + seconds, self.busy_until) - self.now)
        self.cpu += self.busy_share * busy
        self.now += seconds

    def cpu_seconds(self, pgid: int) -> float:
        assert pgid == 7
        return self.cpu


def _settle(group: SimulatedGroup, most_s: float = 100.0) -> float:
    from bench.peers.harness import settle
    return settle([7], idle_share=0.1, window_s=0.5, most_s=most_s,
                  cpu_seconds=group.cpu_seconds, clock=lambda: group.now, sleep=group.sleep)


def test_settle_waits_for_a_busy_group_and_not_for_an_idle_one():
    # Busy (a whole core) for 1.5 s: three busy windows, then the first quiet one returns.
    busy = SimulatedGroup(busy_share=1.0, busy_until=1.5)
    assert _settle(busy) == 2.0 and busy.now == 2.0
    # Idle: settle returns after its first quiet window.
    assert _settle(SimulatedGroup(busy_share=1.0, busy_until=0.0)) == 0.5
    # Under the idle share is quiet.
    assert _settle(SimulatedGroup(busy_share=0.09, busy_until=1e9)) == 0.5
    # Never quiet: settle gives up after most_s.
    assert _settle(SimulatedGroup(busy_share=0.2, busy_until=1e9), most_s=3.0) == 3.0
