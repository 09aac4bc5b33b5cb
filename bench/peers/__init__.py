"""`make bench-peers`: DeltaServe against a real peer engine (vLLM-CPU) on the same machine.

Each engine runs in its own process, started once and warmed up; the harness then alternates
timed runs of the same workload between them (>= 3 rounds) and reports each side's output tok/s,
their ratio per round (min/median/max), whether the greedy tokens agree, and each engine's time
against the machine's roofline floor for the workload.

protocol         the line protocol between the harness and an engine process (stdlib only)
engine_process   the harness's side of it: start, command, read replies, stop
vllm_child       the vLLM engine process (runs in vLLM's own virtualenv)
deltaserve_child the DeltaServe engine process (in-process LLM, or worker + scheduler over gRPC)
vllm_venv        finds or installs vLLM-CPU into an ignored virtualenv
roofline         GEMM rate, copy bandwidth and the workload's floor
report           the figures, printed and written to the results file
harness          the command: `python -m bench.peers --workload prefill-heavy --model DIR`
"""
