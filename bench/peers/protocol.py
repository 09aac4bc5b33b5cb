"""The line protocol between the peer harness and an engine process. Standard library only: the
vLLM side imports it inside vLLM's own virtualenv.

    harness -> engine (stdin)       one JSON object per line: {"cmd": "run", "tag": "round-0"},
                                    {"cmd": "quit"}
    engine -> harness (reply fd)    one line per event: PREFIX + JSON, e.g.
                                    {"event": "ready", "engine": "...", "startup_s": 12.3}
                                    {"event": "result", "tag": ..., "wall_s": ..., "cpu_s": ...,
                                     "token_ids": ...}
                                    {"event": "error", "message": "..."}

The engine's stdout is redirected to its stderr before the engine is imported, so nothing an
engine library prints can be mistaken for a reply: replies go to the original stdout only.

The workload file (JSON) holds {"prompts": [[ids]], "output_lens": [n], "warmup": {same}};
the settings (JSON, one argv argument) hold what both engines are configured with.
"""
from __future__ import annotations

import json
import os
import sys

PREFIX = "@@peer "


class Replies:
    """The engine side: replies on the original stdout, everything else printed goes to
    stderr (file descriptor level, so child processes and C code follow)."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def send(self, event: str, **fields) -> None:
        self._out.write(PREFIX + json.dumps({"event": event, **fields}) + "\n")
        self._out.flush()


def commands():
    """The harness's commands, one dict per stdin line, until EOF or {"cmd": "quit"}."""
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            return
        yield cmd


def load_workload(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name: [0] the state, [2] the pgrp, [11] utime, [12]
    stime. None when the process is gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _ticks_to_seconds(ticks: int) -> float:
    return ticks / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by one live process; 0.0 if it is gone."""
    fields = _stat_fields(pid)
    return _ticks_to_seconds(int(fields[11]) + int(fields[12])) if fields else 0.0


def group_cpu_seconds(pgid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by every live process of a process group (this
    one's by default): the engine and whatever it spawned (vLLM's engine core). Linux /proc;
    0.0 elsewhere."""
    pgid = os.getpgrp() if pgid is None else pgid
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0.0
    total = 0
    for name in names:
        fields = _stat_fields(name) if name.isdigit() else None
        if fields and int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return _ticks_to_seconds(total)


def serve(engine_name: str, start, run_one) -> int:
    """The engine process's main loop: start() -> (engine, description), then one run_one(
    engine, tag) -> (wall_s, token_ids, extra fields) per "run" command; engine.close(), if it
    has one, at the end. Errors are replied, not raised."""
    import time

    replies = Replies()
    t0 = time.perf_counter()
    try:
        engine, description = start()
    except Exception as e:  # noqa: BLE001 - the harness reports it
        replies.send("error", message=f"{engine_name} failed to start: {type(e).__name__}: {e}")
        return 1
    replies.send("ready", engine=description, startup_s=time.perf_counter() - t0)
    try:
        for cmd in commands():
            try:
                cpu0 = group_cpu_seconds()
                wall_s, token_ids, extra = run_one(engine, cmd.get("tag", ""))
                cpu_s = group_cpu_seconds() - cpu0
            except Exception as e:  # noqa: BLE001
                replies.send("error",
                             message=f"{engine_name} run failed: {type(e).__name__}: {e}")
                return 1
            replies.send("result", tag=cmd.get("tag", ""), wall_s=wall_s, cpu_s=cpu_s,
                         token_ids=token_ids, **extra)
        return 0
    finally:
        getattr(engine, "close", lambda: None)()
