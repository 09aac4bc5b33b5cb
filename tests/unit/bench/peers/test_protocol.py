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


def test_settle_waits_for_a_busy_group_and_not_for_an_idle_one(tmp_path):
    from bench.peers.harness import settle

    # A child in its own session that spins through 1.5 s of its own CPU time, marks that it
    # stopped, then sleeps: settle must not return while it spins.
    marker = tmp_path / "stopped"
    code = ("import time, pathlib\n"
            "while time.process_time() < 1.5: pass\n"
            f"pathlib.Path({str(marker)!r}).write_text('x')\ntime.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        settle([child.pid], window_s=0.5, most_s=100.0)
        assert marker.exists()
        assert group_cpu_seconds(child.pid) >= 1.0     # /proc counts in clock ticks
        # Idle now: settle returns after its first quiet window, far inside most_s.
        assert settle([child.pid], window_s=0.5, most_s=100.0) < 50.0
    finally:
        child.kill()
        child.wait()
