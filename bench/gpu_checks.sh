#!/usr/bin/env bash
# Every GPU check of DeltaServe in one script, for a machine with an NVIDIA GPU:
#
#   bash bench/gpu_checks.sh [--dry-run] [bench] [profile] [tests] [attention] [fused] [hf]
#                            (none named: bench profile tests, about 8 minutes in all)
#
# --dry-run prints the stages, their limits and their sum, the longest each can run ("at most":
# later runs' floors and every run's kill grace; what a device call's timeout must cover), and
# the tests stage's runs in order (pytest arguments), then exits: no GPU, no wheels, nothing
# written (tests/unit/bench/test_gpu_checks_kit.py reads it).
#
# Each stage has its own time limit (bench 240, profile 180, tests 300, attention 240, fused 400,
# hf 240 s by default; see the environment variables below), so a run that must fit a time
# budget can run the stages one or two at a time. docs/gpu.md says which command answers what.
#   tests      CUDA tests: every `-m gpu` test in tests/, plus in full the modules that test
#              CUDA paths (the ones named below and any tests/**/test_*.py that mentions
#              torch.cuda.is_available, mark.gpu or tests.support.triton_mode);
#              tests/gpu/test_engine_bf16.py with -s so its accepted bf16 divergences are
#              printed and collected into the summary; then the CUDA twins of session 46's
#              features (NEW_CUDA_TESTS: quantized checkpoints, hybrid KV and partial rotary,
#              last MLA at head 576, whose 1024-wide kernels compile slowest), also with -s;
#              then the other modules, then `-m gpu`.
#              Modules that fail to import only for want of grpc_health / grpc_reflection /
#              grpc_tools (absent from some GPU images) are left out and listed.
#   attention  bench/attention_bandwidth.py (qwen3-0.6b heads, bf16), to decide between one
#              unified kernel or two: every available backend at 256 requests x 1024 context;
#              Triton's split-KV decode vs the varlen kernel alone (--unified) there and at
#              16 x 4096 (where splits matter; also without splits); a mixed batch (8 prefill
#              chunks of 512 after 1024 cached + 248 decodes at 1024: per-request two-kernel
#              dispatch vs unified); Triton at block 256; last, a launch-parameter sweep of both
#              designs at the default shape with whatever time the stage has left (--sweep-budget).
#   bench      python -m bench.throughput --preset qwen3-0.6b --warmup with the engine's default
#              flags (the issue's bar), then (unless BENCH_SYNC=0) with --sync-scheduling; the
#              KV cache is sized by profiling (0.9 of the GPU) unless KV_GIB sets a fixed budget.
#   profile    python -m bench.step_profile --preset qwen3-0.6b --warmup: torch.profiler over 50
#              steady decode steps: device busy share, idle per step, top kernels, host phases.
#   hf         transformers generate() on the same model, capped: one batch size (HF_BATCH_SIZES,
#              default 64), the workload's lengths, HF_TIME_BUDGET (60 s), the stage's limit.
#   fused      whether fused RMSNorm and rope pay off: the kernel microbenchmark
#              (python -m bench.fused_ops: torch vs fused at T = 256 and 8192), then the
#              qwen3-0.6b engine three times in the same run: as is, with --fused-ops, and with
#              --async-scheduling (no transformers run), so the end-to-end ratios decide whether
#              either becomes the default.
#
# Writes into ${OUT:-/tmp/gpu_checks}/: env.txt, <stage>.log, results_attention.md,
# results_bench.md (result blocks to append to bench/results.md), and summary.txt, which is also
# printed last.
#
# Optional: wheels under .whl/ are installed into /tmp/site first (for images without them).
# Variants: BENCH_VARIANTS runs the bench again per ';'-separated entry (leading NAME=value words
# are environment, the rest bench.throughput flags; set, it replaces the --sync-scheduling run),
# e.g. "--triton-launch split_waves=6;TORCH_BLAS_PREFER_CUBLASLT=1"; PROFILE_VARIANTS runs the
# profile once per entry of step_profile arguments, e.g. ";--skip 0 --steps 10 --top 25" (the
# steady window, then the first ten steps: the prefills); TESTS_ONLY names the test paths the
# tests stage runs instead of its full selection (for a short device call).
# Environment: PYTHON (default python3), KV_GIB (unset: profiled), HF_BATCH_SIZES (64),
# HF_TIME_BUDGET (60 s), DS_COMMIT (recorded in the notes when the copy has no .git),
# BENCH_LIMIT / PROFILE_LIMIT / TESTS_LIMIT / ATTENTION_LIMIT / FUSED_LIMIT / HF_LIMIT (seconds
# per stage: 240 / 180 / 300 / 240 / 400 / 240; a late run inside a stage still gets a floor of
# 60 s for tests, 20 s for attention). TRITON_INTERPRET is removed from the environment: on a GPU
# every Triton kernel must run compiled.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

DRY=0
[ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
OUT_DIR=${OUT:-/tmp/gpu_checks}
[ "$DRY" = 1 ] || mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
SUMMARY="$OUT_DIR/summary.txt"
[ "$DRY" = 1 ] || : >"$SUMMARY"
NOTE="device run via bench/gpu_checks.sh${DS_COMMIT:+, tree at commit $DS_COMMIT}"
EXPLICIT_TESTS=(tests/unit/kernels/test_triton_attention.py
                tests/unit/worker_service/step/test_cuda_graphs.py
                tests/unit/worker_service/runner/test_kv_profiler.py
                tests/unit/kernels/test_flash_attn_backend.py tests/gpu/test_engine_bf16.py)
# Session 46's CUDA twins, run right after the bf16 checks, quickest answers first.
NEW_CUDA_TESTS=(tests/gpu/test_quantized_cuda.py tests/gpu/test_hybrid_rope_cuda.py
                tests/gpu/test_mla_cuda.py)
STAGE_LIMITS=(bench=240 profile=180 tests=300 attention=240 fused=400 hf=240)

STATUS=0                     # 1 once any test run, benchmark or check fails

say() { echo "$*" | tee -a "$SUMMARY"; }

install_wheels() {
    compgen -G ".whl/*.whl" >/dev/null || return 0
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
}

record_env() {
    {
        date -u
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
            --format=csv 2>&1
        "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "transformers", "flash_attn", "google.protobuf", "grpc", "grpc_health",
             "grpc_reflection", "hypothesis"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "present"))
    except Exception as e:
        print(name, "MISSING:", type(e).__name__, e)
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("cuda", torch.version.cuda, p.name, p.multi_processor_count, "SMs",
          round(p.total_memory / 2**30, 1), "GiB")
EOF
    } >"$OUT_DIR/env.txt" 2>&1
    say "env: $(grep -m1 -E '^cuda ' "$OUT_DIR/env.txt" || echo 'no CUDA device seen')"
}

COLLECT_LIMIT=120            # seconds for the tests stage's collection pass (full selection)

# Test modules whose collection fails only because an optional gRPC package is missing.
uncollectable_modules() {
    timeout --kill-after=10 "$COLLECT_LIMIT" "$PY" -m pytest --collect-only -q \
        -p no:cacheprovider tests/ 2>&1 | "$PY" -c '
import re, sys
current, skip = None, []
for line in sys.stdin:
    m = re.search(r"ERROR collecting (tests/\S+\.py)", line)
    if m:
        current = m.group(1)
    elif current and re.search(r"No module named .(grpc_health|grpc_reflection|grpc_tools)", line):
        skip.append(current)
        current = None
print(" ".join(dict.fromkeys(skip)))'
}

pytest_run() {  # label, then pytest arguments; appends to tests.log, records the exit code
    local label=$1 rc
    shift
    [ "$TESTS_LEFT" -lt 60 ] && TESTS_LEFT=60     # a late run still gets a minute
    echo "== pytest $label: $*" >>"$OUT_DIR/tests.log"
    timeout --signal=INT --kill-after=30 "$TESTS_LEFT" "$PY" -m pytest -q -rfEs \
        -p no:cacheprovider "$@" 2>&1 | tee -a "$OUT_DIR/tests.log"
    rc=$?
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || STATUS=1
    [ "$rc" = 5 ] && rc="0 (no tests selected)"
    say "tests/$label: exit $rc: $(grep -E '(passed|failed|errors?|skipped|deselected).* in [0-9.]+s' \
        "$OUT_DIR/tests.log" | tail -1 | tr -d '=' | sed 's/^ *//')"
}

# The modules that test CUDA paths (EXPLICIT_TESTS and every test file that mentions
# torch.cuda.is_available, mark.gpu or tests.support.triton_mode), unit modules first (kernels,
# graphs, sampler: many quick tests) before the integration and bench ones (each a model or a
# sweep): a run cut by its limit loses the slow ones. On 2026-11-27 sorted order reached none
# of the kernel modules after tests/integration.
cuda_modules() {
    printf '%s\n' "${EXPLICIT_TESTS[@]}" \
        $(grep -rlE 'cuda\.is_available|mark\.gpu|support.triton_mode' --include="test_*.py" tests) \
        | sort -u | awk '{ print (/^tests\/unit\// ? 0 : 1), $0 }' | sort -k1,1n -s | cut -d' ' -f2
}

stage_limit() {  # stage name -> its limit in seconds (the environment's, else the default)
    local kv name=$1 var
    var="$(echo "$name" | tr '[:lower:]' '[:upper:]')_LIMIT"
    for kv in "${STAGE_LIMITS[@]}"; do
        [ "${kv%%=*}" = "$name" ] && { echo "${!var:-${kv#*=}}"; return; }
    done
}

entries() {  # the number of ';'-separated entries in $1 (as read -a splits them), 0 if unset
    local parts=(); [ -n "$1" ] && IFS=';' read -r -a parts <<<"$1"; echo "${#parts[@]}"
}

stage_worst() {  # stage -> the longest it can run: its limit (floored), each later run's floor
    local name=$1 limit runs floor=30 grace=20 later=0  # and every run's kill grace
    limit=$(stage_limit "$name")
    case $name in
        tests) floor=60 grace=30; [ -z "${TESTS_ONLY:-}" ] && later=3 ;;
        bench) later=$(entries "${BENCH_VARIANTS:-}")
               [ -z "${BENCH_VARIANTS:-}" ] && [ "${BENCH_SYNC:-1}" = 1 ] && later=1 ;;
        profile) runs=$(entries "${PROFILE_VARIANTS:-}"); later=$(( runs > 1 ? runs - 1 : 0 )) ;;
        attention) floor=20 later=6 ;;
        fused) later=3 ;;
        hf) floor=0 ;;
    esac
    [ "$limit" -lt "$floor" ] && limit=$floor
    [ "$name" = tests ] && [ -z "${TESTS_ONLY:-}" ] && limit=$(( limit + COLLECT_LIMIT + 10 ))
    echo $(( limit + grace + later * (floor + grace) ))
}

dry_run() {  # the stages, limits and the tests stage's runs, in order; nothing runs
    local s total=0 worst=0 explicit
    for s in "${stages[@]}"; do
        echo "stage $s: limit $(stage_limit "$s") s, at most $(stage_worst "$s") s"
        total=$(( total + $(stage_limit "$s") ))
        worst=$(( worst + $(stage_worst "$s") ))
    done
    echo "limits sum: $total s"
    echo "at most: $worst s (each later run's floor and every kill grace counted; not the" \
        "wheel install and env record before the stages)"
    case " ${stages[*]} " in *" tests "*) ;; *) return 0 ;; esac
    if [ -n "${TESTS_ONLY:-}" ]; then
        echo "tests run selected: -s $TESTS_ONLY"
        return 0
    fi
    explicit=$(cuda_modules | grep -vxF -e tests/gpu/test_engine_bf16.py \
        $(printf -- '-e %s ' "${NEW_CUDA_TESTS[@]}"))
    echo "tests run engine-bf16: -s tests/gpu/test_engine_bf16.py"
    echo "tests run session46: -s ${NEW_CUDA_TESTS[*]}"
    echo "tests run cuda-modules:" $explicit
    echo "tests run marked-gpu: -m gpu tests/ (the modules above ignored)"
}

stage_tests() {
    local start=$SECONDS runs_start skip explicit ignores=() f
    : >"$OUT_DIR/tests.log"
    TESTS_LEFT=${TESTS_LIMIT:-300}
    if [ -n "${TESTS_ONLY:-}" ]; then           # a short device call: just these, in this order
        pytest_run "selected" -s $TESTS_ONLY
        grep -E '^(BF16 DIVERGENCE|NEAR TIE|GRAPHS REFUSED|FAILED|ERROR)' "$OUT_DIR/tests.log" | sed 's/^/  /' \
            | tee -a "$SUMMARY"
        say "tests: $((SECONDS - start)) s"
        return
    fi
    skip=$(uncollectable_modules)     # the whole of tests/ collected: not for TESTS_ONLY
    [ -n "$skip" ] && say "tests: left out (optional gRPC packages missing here): $skip"
    explicit=$(cuda_modules)
    for f in $skip; do explicit=$(echo "$explicit" | grep -vx "$f"); ignores+=("--ignore=$f"); done
    for f in $explicit "${NEW_CUDA_TESTS[@]}"; do ignores+=("--ignore=$f"); done
    # The bf16-vs-transformers checks first (per backend, graphs vs eager), so a
    # stage cut short by its time limit loses the least important runs.
    TESTS_LEFT=${TESTS_LIMIT:-300}      # the runs' limit, after the collection
    runs_start=$SECONDS
    pytest_run "engine-bf16" -s tests/gpu/test_engine_bf16.py
    grep -E '^(BF16 DIVERGENCE|NEAR TIE)' "$OUT_DIR/tests.log" | sed 's/^/  /' | tee -a "$SUMMARY"
    TESTS_LEFT=$(( ${TESTS_LIMIT:-300} - (SECONDS - runs_start) ))
    local mark
    mark=$(wc -l <"$OUT_DIR/tests.log")
    pytest_run "session46" -s "${NEW_CUDA_TESTS[@]}"
    tail -n +"$((mark + 1))" "$OUT_DIR/tests.log" \
        | grep -E '^(BF16 DIVERGENCE|NEAR TIE|GRAPHS REFUSED)' | sed 's/^/  /' | tee -a "$SUMMARY"
    TESTS_LEFT=$(( ${TESTS_LIMIT:-300} - (SECONDS - runs_start) ))
    pytest_run "cuda-modules" $(echo "$explicit" | grep -vxF -e tests/gpu/test_engine_bf16.py \
        $(printf -- '-e %s ' "${NEW_CUDA_TESTS[@]}"))
    TESTS_LEFT=$(( ${TESTS_LIMIT:-300} - (SECONDS - runs_start) ))
    pytest_run "marked-gpu" -m gpu "${ignores[@]}" tests/
    grep -E '^(FAILED|ERROR) ' "$OUT_DIR/tests.log" | sed 's/^/  /' | tee -a "$SUMMARY"
    say "tests: $((SECONDS - start)) s"
}

# The attention lines that go to the summary: one per timed backend or design, the
# split/unified ratios, and the sweep's count, five fastest points, best points and failures.
ATTENTION_SUMMARY='^([a-z_]+ \(block|split/unified|sweep(:| best| failed)|\| [1-5] \|)'
SWEEP_RESERVE=30     # sweep: seconds kept for start-up (imports, batch, reference) and the end

attention_run() {  # one bench/attention_bandwidth.py call; its result lines go to the summary
    local mark rc
    mark=$(wc -l <"$OUT_DIR/attention.log")
    timeout --signal=INT --kill-after=20 "$(( ATT_END - SECONDS < 20 ? 20 : ATT_END - SECONDS ))" \
        "$PY" -m bench.attention_bandwidth --results-file "$OUT_DIR/results_attention.md" \
        --note "$NOTE" "$@" 2>&1 | tee -a "$OUT_DIR/attention.log"
    rc=$?
    [ "$rc" = 0 ] || { STATUS=1; say "  [${*}] exit $rc"; }
    tail -n +"$((mark + 1))" "$OUT_DIR/attention.log" | grep -E "$ATTENTION_SUMMARY" \
        | sed "s/^/  [${*}] /" | tee -a "$SUMMARY"
}

stage_attention() {
    local start=$SECONDS budget
    : >"$OUT_DIR/attention.log"
    ATT_END=$(( SECONDS + ${ATTENTION_LIMIT:-240} ))
    say "attention (default shape: 256 requests x 1024 context, 16/8 heads, head_dim 128, bf16):"
    attention_run --all-backends
    attention_run --backend triton --unified
    attention_run --backend triton --num-reqs 16 --context 4096 --unified
    attention_run --backend triton --num-reqs 16 --context 4096 --decode-splits 1
    attention_run --backend triton --mixed
    attention_run --backend triton --block-size 256
    budget=$(( ATT_END - SECONDS - SWEEP_RESERVE ))
    [ "$budget" -lt 10 ] && budget=10
    attention_run --backend triton --sweep --unified --sweep-budget "$budget"
    say "attention: $((SECONDS - start)) s; $(grep -m1 '^measured copy' "$OUT_DIR/attention.log")"
}

run_variant() {  # log file, limit (s), variant ("NAME=value ... --flags"), python arguments
    local log=$1 limit=$2 envs=() flags=() w
    shift 2
    for w in $1; do
        if [[ ${#flags[@]} -eq 0 && $w =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$w"); else flags+=("$w"); fi
    done
    shift
    timeout --signal=INT --kill-after=20 "$limit" env "${envs[@]}" "$PY" "$@" "${flags[@]}" 2>&1 \
        | grep -v -E 'nanobind|^ - ' | tee -a "$log"
    return "${PIPESTATUS[0]}"
}

stage_bench() {
    local start=$SECONDS rc kv_note="profiled, 0.9 of the GPU" flags left
    [ -n "${KV_GIB:-}" ] && kv_note="fixed ${KV_GIB} GiB (--kv-cache-gib)"
    : >"$OUT_DIR/bench.log"
    local variants=("")
    if [ -n "${BENCH_VARIANTS:-}" ]; then
        IFS=';' read -r -a more <<<"$BENCH_VARIANTS"
        variants+=("${more[@]}")
    elif [ "${BENCH_SYNC:-1}" = 1 ]; then
        variants+=("--sync-scheduling")
    fi
    for flags in "${variants[@]}"; do
        left=$(( ${BENCH_LIMIT:-240} - (SECONDS - start) ))
        echo "== bench [${flags:-default flags}]" >>"$OUT_DIR/bench.log"
        run_variant "$OUT_DIR/bench.log" "$(( left < 30 ? 30 : left ))" "$flags" \
            -m bench.throughput --preset qwen3-0.6b --warmup \
            ${KV_GIB:+--kv-cache-gib "$KV_GIB"} --results-file "$OUT_DIR/results_bench.md" \
            --note "$NOTE" --note "KV cache: $kv_note" ${flags:+--note "variant: $flags"}
        rc=$?
        [ "$rc" = 0 ] || STATUS=1
        say "bench [${flags:-default flags}]: exit $rc"
    done
    say "bench: $((SECONDS - start)) s"
    grep -E '^(== bench|engine|output throughput|decode steps|decode read|other steps|outside steps|triton comp)' \
        "$OUT_DIR/bench.log" | sed 's/^/  /' | tee -a "$SUMMARY"
}

stage_profile() {
    local start=$SECONDS rc args left variants=("")
    : >"$OUT_DIR/profile.log"
    [ -n "${PROFILE_VARIANTS:-}" ] && IFS=';' read -r -a variants <<<"$PROFILE_VARIANTS"
    for args in "${variants[@]}"; do
        left=$(( ${PROFILE_LIMIT:-180} - (SECONDS - start) ))
        echo "== profile [${args:-defaults}]" >>"$OUT_DIR/profile.log"
        run_variant "$OUT_DIR/profile.log" "$(( left < 30 ? 30 : left ))" "$args" \
            -m bench.step_profile --preset qwen3-0.6b --warmup ${KV_GIB:+--kv-cache-gib "$KV_GIB"}
        rc=$?
        [ "$rc" = 0 ] || STATUS=1
        say "profile [${args:-defaults}]: exit $rc"
    done
    say "profile: $((SECONDS - start)) s"
    grep -E '^(== profile|engine:|run:|device busy|per step|decode attention|allocator|  (engine|runner):)' "$OUT_DIR/profile.log" \
        | sed 's/^/  /' | tee -a "$SUMMARY"
    grep -A 6 -E '^(top kernels|gaps over)' "$OUT_DIR/profile.log" | sed 's/^/  /' | tee -a "$SUMMARY"
}

stage_hf() {
    local start=$SECONDS rc
    timeout --signal=INT --kill-after=20 "${HF_LIMIT:-240}" \
        "$PY" -m bench.throughput --preset qwen3-0.6b --warmup --vs-transformers \
        --hf-batch-sizes "${HF_BATCH_SIZES:-64}" --hf-time-budget "${HF_TIME_BUDGET:-60}" \
        ${KV_GIB:+--kv-cache-gib "$KV_GIB"} --results-file "$OUT_DIR/results_bench.md" \
        --note "$NOTE" 2>&1 | tee "$OUT_DIR/hf.log"
    rc=$?
    [ "$rc" = 0 ] || STATUS=1
    say "hf: exit $rc, $((SECONDS - start)) s"
    grep -E '^(transformers|ours /)' "$OUT_DIR/hf.log" | sed 's/^/  /' | tee -a "$SUMMARY"
}

fused_run() {  # label, then python arguments; output appended to fused.log
    local label=$1 rc
    shift
    echo "== $label: $*" >>"$OUT_DIR/fused.log"
    timeout --signal=INT --kill-after=20 "$(( FUSED_END - SECONDS < 30 ? 30 : FUSED_END - SECONDS ))" \
        "$PY" "$@" 2>&1 | tee -a "$OUT_DIR/fused.log"
    rc=$?
    [ "$rc" = 0 ] || { STATUS=1; say "  [$label] exit $rc"; }
}

stage_fused() {
    local start=$SECONDS kv=()
    : >"$OUT_DIR/fused.log"
    FUSED_END=$(( SECONDS + ${FUSED_LIMIT:-400} ))
    [ -n "${KV_GIB:-}" ] && kv=(--kv-cache-gib "$KV_GIB")
    fused_run microbench -m bench.fused_ops --results-file "$OUT_DIR/results_fused.md" \
        --note "$NOTE"
    for flag in "" --fused-ops --async-scheduling; do
        fused_run "engine ${flag:-torch ops}" -m bench.throughput --preset qwen3-0.6b --warmup \
            ${flag} "${kv[@]}" --results-file "$OUT_DIR/results_fused.md" --note "$NOTE"
    done
    say "fused: $((SECONDS - start)) s"
    grep -E '^(\||engine|output throughput|decode steps)' "$OUT_DIR/fused.log" | sed 's/^/  /' \
        | tee -a "$SUMMARY"
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(bench profile tests)
for s in "${stages[@]}"; do
    case $s in tests|attention|bench|profile|fused|hf) ;;
        *) echo "unknown stage '$s': bench, profile, tests, attention, fused or hf" >&2
           exit 2 ;; esac
done
[ "$DRY" = 1 ] && { dry_run; exit 0; }
install_wheels || say "wheel install failed: continuing without .whl/"
record_env
for s in "${stages[@]}"; do "stage_$s"; done
say "overall: $([ "$STATUS" = 0 ] && echo ok || echo 'FAILURES (see above and the logs)')"
echo
echo "===== summary ($OUT_DIR) ====="
cat "$SUMMARY"
exit "$STATUS"
