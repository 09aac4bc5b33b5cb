"""Offline benchmarks of the in-process engine (`make bench`, `deltaserve bench`).

presets      named architectures with random weights of the real shape (nothing downloaded)
workload     nano-vllm's workload: random prompt ids, random input and output lengths
step_timer   observes LLMEngine steps: which were pure decode, how long, how much KV they read
bandwidth    bytes a decode step must read, and the device's measured copy bandwidth
hf_baseline  transformers `generate()` on the same prompts, over a few batch sizes
report       the result block appended to bench/results.md
isa          the CPU's description, and --isa avx2 (an AVX2 machine emulated) for bench.peers
throughput   the command: `python -m bench.throughput --preset qwen3-0.6b --vs-transformers`
"""
