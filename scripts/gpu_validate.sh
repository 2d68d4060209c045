#!/usr/bin/env bash
# One-call GPU validation of the NVIDIA backend: environment, kernel build, every command of the README and docs/cli.md
# as a user runs it, the backend's GPU tests against the CPU reference, the conformance suite,
# compute-sanitizer (memcheck, racecheck) and the benchmark. Every stage logs to $OUT (default
# ./out) and the script ends with a summary; a failing stage does not stop the later ones.
#
#   OUT=/tmp/out bash scripts/gpu_validate.sh [stages...]     # stages: env readme tests tests_variants conformance memcheck racecheck ncu bench host_reads pool_release
#                                                             #         tf_tests tf_generate tf_bench tf_assisted_bench (the transformers integration), triton triton_bench, vllm_ops_bench, serving
#                                                             #         triton_tests triton_conformance triton_generate (the triton stage split, to run side by side), triton_conformance_env
#                                                             #         vllm_tests (vLLM's kernel tests, see there)
#                                                             #         serving_locality locality tf_resident (issue 42: under the calibrated locality model, not in the defaults)
#                                                             #         memcheck_vllm_ops racecheck_vllm_ops ncu_vllm_ops ncu_triton triton_ipc (issues 39, 40)
#                                                             #         tp_shared (issue 20: two ranks sharing one host pool, not in the defaults)
#                                                             #         bench_smoke (every GPU bench script once, small: after a change to their flags)
#
# TESTS_K selects tests of the tests stage by a pytest -k expression.
# Stage time limits (seconds) come from T_ENV, T_README, T_TESTS, T_CONFORMANCE, T_MEMCHECK,
# T_RACECHECK and T_BENCH (T_HOST_READS, T_POOL_RELEASE); BENCH_ARGS (HOST_READS_ARGS,
# POOL_RELEASE_ARGS) passes extra arguments to bench/bench_nvidia.py (bench/bench_host_reads.py,
# bench/bench_pool_release.py). README_LARGE_REFERENCE=0 skips the reference_cpu run of the large
# workload in the readme stage (the slowest command there).
#
# serving_locality runs bench/bench_serving.py once per name in SERVING_LOCALITY_RUNS (default
# "benign+indexer-share code": --topk-model of that regime; "-no-indexer" adds --skip-indexer, every
# row without the model's indexer; "+indexer-share" adds --indexer-share $SERVING_INDEXER_SHARE (default
# max: rows without it at each mode's largest batch beside the others; max@131072: at 128K only); "+prefetch"
# adds --prefetch-next-group off/on (every hisparse row without and with the cross-layer prefetch; for
# off/on/auto, auto leaving the regime's poor layers out as sources, put the flag in SERVING_LOCALITY_ARGS
# and leave "+prefetch" out, which would override it);
# "+hisparse-only" --modes hisparse (after the arguments below, so it wins); "+adjacent" --reference-layers
# $SERVING_REFERENCE_LAYERS (default 20,21,22,23/spread: every hisparse row with the model's 4 layers standing for
# adjacent reference layers of the plateau band, then for the spread 0/20/40/60)); T_SERVING_LOCALITY seconds each, default 140;
# SERVING_LOCALITY_ARGS replaces the default arguments: 4 layers, --dense-ffn-gb 4.6, 128K then 32K,
# a 3 GiB budget (all-resident also at hisparse's batches under 24 GiB), batches all-resident's
# largest at the budget and hisparse's largest, 5 timed steps after 5 untimed, hisparse with and
# without the regime's resident layers (--resident-layers none/auto: layer 0 under code)), then
# bench/plot_serving_regimes.py on the logs (rows are read from the logs, so a run cut short by
# its time limit still counts). tf_resident runs the GPU test of resident layers in a captured
# decode graph (T_TF_RESIDENT, default 60). locality runs bench/bench_locality.py
# --no-policies on the nvidia backend (the replay engine with and without a resident layer; T_LOCALITY,
# LOCALITY_ARGS, default --top-k 2048).
#
# tp_shared runs bench/bench_tp_shared.py --json $OUT/tp_shared.json (T_TP_SHARED, default 300;
# TP_SHARED_ARGS adds arguments, e.g. --quick or --devices 0,0): two rank processes share one
# /dev/shm pool, rank r on GPU r % device count (both on GPU 0 on a one-GPU machine, one GPU each on
# nvidia-h200-x2); workload bit-exact against reference_cpu on both ranks, delayed write, memory,
# swap-in cost beside a private pool, and faults. NVLink multicast stays off (the script sets
# NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 for it).
#
# The machine needs python3 with torch (CUDA), cuda-python (cuda.bindings + NVRTC), pytest,
# hypothesis, pluggy and numpy. The repository is used in place: a small shim directory maps the
# hisparse_* import names to the source folders and declares the entry points, so nothing is
# installed.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/out}
mkdir -p "$OUT"
STAGES=${*:-env readme tests conformance memcheck racecheck bench}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export HISPARSE_KERNEL_CACHE=${HISPARSE_KERNEL_CACHE:-/tmp/hisparse-kernels}

# ---- import shim -----------------------------------------------------------------------------
SHIM=/tmp/hisparse_shim.$$
rm -rf "$SHIM" && mkdir -p "$SHIM/hisparse-0.1.0.dist-info"
ln -s "$REPO/hisparse_core" "$SHIM/hisparse_core"
# NVIDIA_ROOT: another tree's backends/nvidia (a before/after comparison of the kernels)
ln -s "${NVIDIA_ROOT:-$REPO}/backends/nvidia/hisparse_nvidia" "$SHIM/hisparse_nvidia"
ln -s "$REPO/backends/reference_cpu/hisparse_reference_cpu" "$SHIM/hisparse_reference_cpu"
[ -d "$REPO/backends/triton/hisparse_triton" ] && ln -s "$REPO/backends/triton/hisparse_triton" "$SHIM/hisparse_triton"
ln -s "$REPO/plugins/conformance/hisparse_conformance" "$SHIM/hisparse_conformance"
[ -d "$REPO/plugins/vllm/hisparse_vllm" ] && ln -s "$REPO/plugins/vllm/hisparse_vllm" "$SHIM/hisparse_vllm"
# TRANSFORMERS_ROOT: another tree's plugins/transformers (a before/after comparison of the engine)
TF_ROOT=${TRANSFORMERS_ROOT:-$REPO}
[ -d "$TF_ROOT/plugins/transformers/hisparse_transformers" ] && ln -s "$TF_ROOT/plugins/transformers/hisparse_transformers" "$SHIM/hisparse_transformers"
printf 'Metadata-Version: 2.1\nName: hisparse\nVersion: 0.1.0\n' > "$SHIM/hisparse-0.1.0.dist-info/METADATA"
python3 - "$REPO/pyproject.toml" > "$SHIM/hisparse-0.1.0.dist-info/entry_points.txt" <<'EOF'
import sys, tomllib
eps = tomllib.load(open(sys.argv[1], "rb"))["project"].get("entry-points", {})
for group, entries in eps.items():
    print(f"[{group}]")
    for k, v in entries.items():
        print(f"{k} = {v}")
    print()
EOF
export PYTHONPATH=$SHIM${PYTHONPATH:+:$PYTHONPATH}

declare -A RC
run() {  # run NAME TIMEOUT CMD...
    local name=$1 limit=$2; shift 2
    echo "=== [$name] $*" | tee "$OUT/$name.log"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
    RC[$name]=$?
    echo "=== [$name] rc=${RC[$name]} in $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
}

for stage in $STAGES; do
case $stage in
env)
    run env "${T_ENV:-80}" bash -c '
        date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
        python3 -c "import sys, torch; print(sys.version); print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
        python3 -m pip list 2>/dev/null | grep -i -E "^(cuda|nvidia-cuda-nvrtc|pytest|hypothesis|pluggy|numpy) "
        which compute-sanitizer; echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1)"
        python3 -c "
from hisparse_nvidia.plugin import probe; print(\"probe:\", probe())
from hisparse_nvidia.compiler import nvrtc_version, supported_archs; print(\"nvrtc\", nvrtc_version(), supported_archs())
import time
from hisparse_nvidia.kernels import all_builds_for_ci
from hisparse_nvidia.compiler import compile_kernel
for b in all_builds_for_ci():
    t = time.perf_counter(); c = compile_kernel(b, 90); print(b.source, dict(b.defines), c.kind, len(c.image), f\"{time.perf_counter() - t:.2f}s\")
"
        python3 -m hisparse_core backends 2>&1 | head -20'
    ;;
readme)  # every command of README.md and docs/cli.md as a user runs it (through the shim: python3 -m hisparse_core),
    # the main job automatic and explicit, default and large workload, each against reference_cpu
    run readme "${T_README:-420}" bash -c '
        set -u; rc=0; O=$0
        must() { echo "--- $*"; "$@" || { echo "FAILED (rc=$?): $*"; rc=1; }; }
        json() { local out=$1; shift; echo "--- $* > $out"; "$@" > "$O/$out" || { echo "FAILED (rc=$?): $*"; rc=1; }; }
        must python3 -m hisparse_core backends
        must python3 -m hisparse_core generate --no-progress
        must python3 -m hisparse_core generate --backend nvidia --model glm_moe_dsa --no-progress
        must python3 -m hisparse_core run --no-progress
        json run_nvidia.json python3 -m hisparse_core run --backend nvidia --no-progress --json
        json run_reference_cpu.json python3 -m hisparse_core run --backend reference_cpu --no-progress --json
        must python3 bench/compare_runs.py "$O/run_nvidia.json" "$O/run_reference_cpu.json" --expect-backend nvidia
        json large_auto.json python3 -m hisparse_core run --preset large --no-progress --json
        if [ "${README_LARGE_REFERENCE:-1}" != 0 ]; then
            json large_reference_cpu.json python3 -m hisparse_core run --preset large --backend reference_cpu --no-progress --json
            must python3 bench/compare_runs.py "$O/large_auto.json" "$O/large_reference_cpu.json" --expect-backend nvidia
        fi
        must python3 -m hisparse_core bench
        must python3 -m hisparse_core bench --backend nvidia --json
        must python3 -m hisparse_core plan
        exit $rc' "$OUT"
    ;;
tests)  # 300 s by default: test_nvidia_tp_shared.py runs bench_tp_shared.py --quick on GPU 0 (not yet timed there)
    run tests "${T_TESTS:-300}" python3 -m pytest -q -rs --maxfail=10 -p no:cacheprovider ${TESTS_ARGS:-} tests/nvidia_backend ${TESTS_K:+-k "$TESTS_K"}
    ;;
tests_variants)  # the resolver tests again with the page tables gathered per entry
    # (HISPARSE_RESOLVE_SMEM=0), with 512 threads per block and with one block per group at every
    # batch (HISPARSE_RESOLVE_CLUSTER=1). VARIANTS (';'-separated
    # assignments) overrides the list.
    export VARIANTS=${VARIANTS:-"HISPARSE_RESOLVE_SMEM=0;HISPARSE_RESOLVE_THREADS=512;HISPARSE_RESOLVE_CLUSTER=1"}
    run tests_variants "${T_TESTS:-200}" bash -c '
        set -u; rc=0; T="tests/nvidia_backend/test_nvidia_runtime.py tests/nvidia_backend/test_nvidia_graph.py"
        IFS=";" read -ra VS <<< "$VARIANTS"
        for v in "${VS[@]}"; do
            echo "--- $v"; env $v python3 -m pytest -q -rs --maxfail=5 -p no:cacheprovider $T || rc=1
        done; exit $rc'
    ;;
conformance)
    run conformance "${T_CONFORMANCE:-150}" python3 -m pytest -q -rs -p no:cacheprovider --pyargs hisparse_conformance \
        --hisparse-backend nvidia --hisparse-examples ${CONFORMANCE_EXAMPLES:-25}
    ;;
memcheck)
    T=tests/nvidia_backend/test_nvidia_runtime.py
    run memcheck "${T_MEMCHECK:-110}" compute-sanitizer --tool memcheck --report-api-errors no --leak-check no --error-exitcode 99 --print-limit 50 \
        python3 -m pytest -q -p no:cacheprovider "$T::test_small_geometries_match_reference[0]" \
        "$T::test_small_geometries_match_reference[1]" "$T::test_small_geometries_match_reference[5]" \
        "$T::test_production_geometry_matches_reference[1-None-None-None]" "$T::test_production_geometry_matches_reference[2-None-None-None]" "$T::test_production_geometry_matches_reference[1-0-None-None]" "$T::test_production_geometry_matches_reference[1-None-1-None]" "$T::test_production_geometry_matches_reference[1-None-None-2]" "$T::test_mirror_spill_restore_and_host_copies" \
        "$T::test_cluster_resolver_matches_reference[0]" "$T::test_cluster_resolver_matches_reference[1]" "$T::test_cluster_resolver_matches_reference[5]" \
        "$T::test_strided_device_blocks" "$T::test_out_of_context_positions_are_masked_without_validation" \
        "$T::test_remapped_and_shared_host_blocks_match_reference[0]" "$T::test_speculative_gather_matches_reference[0]" \
        "$T::test_speculative_gather_matches_reference[2]" "tests/nvidia_backend/test_nvidia_graph.py::test_graph_replay_across_drifting_steps[2]" \
        "tests/nvidia_backend/test_nvidia_graph.py::test_graph_replay_across_drifting_steps[1-split]" tests/nvidia_backend/test_nvidia_transfer.py \
        "$T::test_plan_copy_per_sm_limit_and_trace[0]" "$T::test_plan_copy_per_sm_limit_and_trace[2]" \
        "tests/nvidia_backend/test_nvidia_graph.py::test_graph_replay_across_drifting_steps[1-padded]" \
        "$T::test_speculative_gather_early_exit_matches_reference[0]" "$T::test_speculative_gather_early_exit_matches_reference[2]" \
        ${MEMCHECK_EXTRA:-}
    ;;
racecheck)
    T=tests/nvidia_backend/test_nvidia_runtime.py
    run racecheck "${T_RACECHECK:-90}" compute-sanitizer --tool racecheck --report-api-errors no --racecheck-report hazard --error-exitcode 99 --print-limit 50 \
        python3 -m pytest -q -p no:cacheprovider "$T::test_small_geometries_match_reference[2]" \
        "$T::test_small_geometries_match_reference[3]" "$T::test_production_geometry_matches_reference[1-None-None-None]" \
        "$T::test_production_geometry_matches_reference[1-None-1-None]" "$T::test_cluster_resolver_matches_reference[1]" \
        "$T::test_remapped_and_shared_host_blocks_match_reference[1]" "$T::test_speculative_gather_matches_reference[4]" \
        "$T::test_plan_copy_per_sm_limit_and_trace[0]" "$T::test_speculative_gather_early_exit_matches_reference[0]"
    ;;
memcheck_vllm_ops|racecheck_vllm_ops)  # compute-sanitizer over vllm_ops.cu's kernels (issue 39); VLLM_OPS_SANITIZE_K picks the tests
    tool=${stage%%_*}
    extra=(--leak-check no)
    [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
    run "$stage" "${T_SANITIZE_VLLM_OPS:-150}" compute-sanitizer --tool "$tool" --report-api-errors no "${extra[@]}" \
        --error-exitcode 99 --print-limit 50 python3 -m pytest -q -p no:cacheprovider tests/nvidia_backend/test_nvidia_vllm_ops.py \
        -k "${VLLM_OPS_SANITIZE_K:-0] or 4] or 4sp] or production or capture or no_tables}"
    ;;
ncu_vllm_ops)  # per-kernel profile of vLLM's call sequence on nvidia's ops (NCU_VLLM_ARGS: bench_nvidia.py --vllm-ops cells;
    # NCU_VLLM_SECTIONS: further ncu arguments, e.g. "--section SourceCounters" for the hottest instructions)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    # shellcheck disable=SC2086
    run ncu_vllm_ops "${T_NCU:-150}" "$NCU" --clock-control none --section SpeedOfLight --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis ${NCU_VLLM_SECTIONS:-} --print-details all -k regex:hisparse_vllm \
        --launch-skip "${NCU_SKIP:-6}" --launch-count "${NCU_COUNT:-9}" python3 bench/bench_nvidia.py --vllm-ops --replays 1 \
        ${NCU_VLLM_ARGS:---vllm-ops-misses 0 --vllm-ops-batches 128 --vllm-ops-rows 1}
    ;;
ncu_triton)  # per-kernel profile of the triton backend on bench_triton.py's cells (NCU_TRITON_CELLS; NCU_TRITON_ARGS: more, e.g. --variants V)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    run ncu_triton "${T_NCU:-150}" "$NCU" --clock-control none --section SpeedOfLight --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters --print-details all \
        -k regex:"${NCU_TRITON_KERNELS:-resolve_kernel|resolve_gather_kernel|resolve_split|copy_plan_kernel|copy_spec_kernel}" --launch-skip "${NCU_SKIP:-6}" \
        --launch-count "${NCU_COUNT:-4}" python3 bench/bench_triton.py --no-nvidia --replays 1 --cells "${NCU_TRITON_CELLS:-0:8}" \
        ${NCU_TRITON_ARGS:-}
    ;;
ncu)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    run ncu "${T_NCU:-150}" "$NCU" --clock-control none --section SpeedOfLight --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section InstructionStats --print-details all \
        -k regex:hisparse_ --launch-skip 2 --launch-count 12 python3 bench/bench_nvidia.py --profile-target
    ;;
bench)
    run bench "${T_BENCH:-170}" python3 bench/bench_nvidia.py --json "$OUT/bench.json" ${BENCH_ARGS:-}
    ;;
tf_tests)  # the transformers integration on the GPU (fp32 exact, bf16 teacher-forced, planted fault, graphs)
    # TF_TESTS_FILES replaces the two files (`all`: the nine files with GPU tests, the rule after a change to
    # the plugin; a brace pattern is not expanded here), TF_TESTS_EXTRA adds files, TF_TESTS_ARGS adds
    # pytest arguments. -v: a run its time limit cuts off still names every test that finished (R1-R2 ran
    # out under -q).
    tf_files=${TF_TESTS_FILES:-tests/transformers_plugin/test_transformers_gpu.py tests/transformers_plugin/test_transformers_graphs.py}
    if [ "$tf_files" = all ]; then
        tf_files=$(printf 'tests/transformers_plugin/test_transformers_%s.py ' gpu graphs assisted_gpu indexer_keys \
            resident_layers prefetch cache_modes kv_rows gpu_ranks)
    fi
    # shellcheck disable=SC2086
    run tf_tests "${T_TF_TESTS:-200}" python3 -m pytest -v -rs -s -p no:cacheprovider $tf_files ${TF_TESTS_EXTRA:-} \
        ${TF_TESTS_ARGS:-}
    ;;
triton)  # the triton backend compiled: its tests, then the conformance suite on it
    run triton "${T_TRITON:-300}" bash -c '
        rc=0; python3 -m pytest -q -rs -p no:cacheprovider tests/triton_backend || rc=1
        python3 -m pytest -q -rs -p no:cacheprovider --pyargs hisparse_conformance --hisparse-backend triton \
            --hisparse-examples ${TRITON_EXAMPLES:-25} || rc=1; exit $rc'
    ;;
triton_tests)  # the triton backend's own tests, compiled (the AMD/sm_90 compile check among them;
    # TRITON_TESTS_ARGS adds pytest arguments without spaces, e.g. --ignore=tests/triton_backend/test_compile_targets.py)
    run triton_tests "${T_TRITON:-300}" python3 -m pytest -q -rs -p no:cacheprovider tests/triton_backend ${TRITON_TESTS_ARGS:-}
    ;;
triton_ipc)  # issue 40: a shared pool's peer waits for rank 0's writes on the GPU (two processes, verbose)
    run triton_ipc "${T_TRITON_IPC:-120}" python3 -m pytest -q -rs -s -p no:cacheprovider tests/triton_backend/test_triton_ipc_gpu.py \
        tests/nvidia_backend/test_nvidia_ipc_wait.py
    ;;
triton_conformance)  # the conformance suite on triton, compiled (target: under 5 minutes)
    run triton_conformance "${T_TRITON_CONFORMANCE:-300}" python3 -m pytest -q -rs -p no:cacheprovider --durations=5 \
        --pyargs hisparse_conformance --hisparse-backend triton --hisparse-examples ${TRITON_EXAMPLES:-25}
    ;;
triton_conformance_env)  # the same suite with the HISPARSE_TRITON_* settings of TRITON_CONFORMANCE_ENV (default-off variants)
    # shellcheck disable=SC2086
    run triton_conformance_env "${T_TRITON_CONFORMANCE:-300}" env ${TRITON_CONFORMANCE_ENV:-} python3 -m pytest -q -rs \
        -p no:cacheprovider --durations=5 --pyargs hisparse_conformance --hisparse-backend triton \
        --hisparse-examples ${TRITON_EXAMPLES:-25}
    ;;
triton_generate)  # hisparse generate on the triton backend: EXACT against the model without hisparse
    run triton_generate "${T_TRITON_GENERATE:-240}" python3 -m hisparse_core generate --backend triton --no-progress
    ;;
triton_bench)
    run triton_bench "${T_TRITON_BENCH:-240}" python3 bench/bench_triton.py --json "$OUT/triton_bench.json" ${TRITON_BENCH_ARGS:-}
    ;;
vllm_ops_bench)  # vLLM's call sequence on hisparse's op set beside the native swap-in (VLLM_OPS_ARGS)
    run vllm_ops_bench "${T_VLLM_OPS_BENCH:-150}" python3 bench/bench_nvidia.py --vllm-ops ${VLLM_OPS_ARGS:-}
    ;;
vllm_tests)  # vLLM's own kernel tests (tests/kernels/attention/test_hisparse_kernels.py, copied unchanged into
    # the git-ignored .vllm_tests/, never committed; the call carries it) against nvidia's op set (another
    # backend's with HISPARSE_BACKEND in VLLM_TESTS_ENV):
    # scripts/vllm_tests_shim/vllm stands in for the `vllm` import and registers the ops through hisparse_vllm.ops;
    # VLLM_TESTS_ENV: HISPARSE_VLLM_* settings for this stage alone (a default-off build, e.g. HISPARSE_VLLM_RESOLVE=6)
    if [ ! -f "$REPO/.vllm_tests/test_hisparse_kernels.py" ]; then
        echo "=== [vllm_tests] .vllm_tests/test_hisparse_kernels.py is missing: copy vLLM's tests/kernels/attention/test_hisparse_kernels.py there unchanged and name .vllm_tests in the call's carry" | tee "$OUT/vllm_tests.log"
        RC[vllm_tests]=2
    else
        run vllm_tests "${T_VLLM_TESTS:-150}" env ${VLLM_TESTS_ENV:-} PYTHONPATH="$REPO/scripts/vllm_tests_shim:$PYTHONPATH" python3 -m pytest -q -rs \
            -p no:cacheprovider "$REPO/.vllm_tests/test_hisparse_kernels.py"
    fi
    ;;
serving)  # issue 29: decode throughput at a fixed GPU KV budget (SERVING_ARGS)
    run serving "${T_SERVING:-400}" python3 bench/bench_serving.py --json "$OUT/serving.json" --png "$OUT/serving.png" \
        ${SERVING_ARGS:-}
    ;;
serving_locality)  # issue 42: serving under the calibrated locality, each run of SERVING_LOCALITY_RUNS, and the plot
    logs=()
    RC[serving_locality]=0
    for name in ${SERVING_LOCALITY_RUNS:-benign+indexer-share code}; do
        regime=${name%%[-+]*}
        skip=()
        [[ "$name" == *-no-indexer* ]] && skip+=(--skip-indexer)
        [[ "$name" == *+indexer-share* ]] && skip+=(--indexer-share "${SERVING_INDEXER_SHARE:-max}")
        after=()  # after the arguments, so they win over SERVING_LOCALITY_ARGS's
        [[ "$name" == *+prefetch* ]] && after+=(--prefetch-next-group off/on)
        [[ "$name" == *+hisparse-only* ]] && after+=(--modes hisparse)
        [[ "$name" == *+adjacent* ]] && after+=(--reference-layers "${SERVING_REFERENCE_LAYERS:-20,21,22,23/spread}")
        # shellcheck disable=SC2086  # the arguments split on purpose
        run "serving_$name" "${T_SERVING_LOCALITY:-140}" python3 bench/bench_serving.py --topk-model "$regime" "${skip[@]}" \
            --json "$OUT/serving_$name.json" --png "$OUT/serving_$name.png" \
            ${SERVING_LOCALITY_ARGS:---layers 4 --dense-ffn-gb 4.6 --contexts 131072,32768 --gpu-kv-gib 3 --all-resident-gib 24 --modes hisparse,all-resident --batches budget,max --warmup 5 --steps 5 --resident-layers none/auto} \
            "${after[@]}"
        logs+=("$OUT/serving_$name.log")
        RC[serving_locality]=$(( RC[serving_locality] | RC[serving_$name] ))
    done
    run serving_regimes 60 python3 bench/plot_serving_regimes.py "${logs[@]}" --png "$OUT/serving_regimes.png"
    RC[serving_locality]=$(( RC[serving_locality] | RC[serving_regimes] ))
    ;;
tf_resident)  # issue 42: resident layers in the transformers engine, decode steps replayed from a CUDA graph
    run tf_resident "${T_TF_RESIDENT:-60}" python3 -m pytest -q -rs -s -p no:cacheprovider \
        tests/transformers_plugin/test_transformers_resident_layers.py -k captured_decode_graph
    ;;
locality)  # issue 42: the replay engine with and without a resident layer, on the GPU
    # shellcheck disable=SC2086
    run locality "${T_LOCALITY:-120}" python3 bench/bench_locality.py --no-policies --backend nvidia ${LOCALITY_ARGS:---top-k 2048}
    ;;
tf_generate)  # TF_GENERATE_ARGS adds generate's arguments (e.g. --dtype bfloat16)
    # shellcheck disable=SC2086
    run tf_generate "${T_TF_GENERATE:-120}" python3 -m hisparse_core generate --backend nvidia --no-progress ${TF_GENERATE_ARGS:-}
    ;;
tf_bench)
    run tf_bench "${T_TF_BENCH:-330}" python3 bench/bench_transformers.py --backend nvidia --json "$OUT/tf_bench.json" ${TF_BENCH_ARGS:-}
    ;;
tf_assisted_bench)  # prompt-lookup decoding through hisparse against plain greedy decode (ASSISTED_BENCH_ARGS)
    # shellcheck disable=SC2086
    run tf_assisted_bench "${T_TF_ASSISTED_BENCH:-240}" python3 bench/bench_assisted.py --json "$OUT/tf_assisted_bench.json" \
        ${ASSISTED_BENCH_ARGS:---contexts 32768 --batches 1,8 --k 3 --layers 4}
    ;;
host_reads)
    run host_reads "${T_HOST_READS:-240}" python3 bench/bench_host_reads.py --json "$OUT/host_reads.json" ${HOST_READS_ARGS:-}
    ;;
tp_shared)  # issue 20: one host pool shared by two ranks (rank r on GPU r % count); multicast off
    run tp_shared "${T_TP_SHARED:-300}" env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python3 bench/bench_tp_shared.py --json "$OUT/tp_shared.json" ${TP_SHARED_ARGS:-}
    ;;
pool_release)  # release() and SIGTERM-to-exit of a registered pool (64 GiB unless POOL_RELEASE_ARGS says)
    run pool_release "${T_POOL_RELEASE:-500}" python3 bench/bench_pool_release.py --json "$OUT/pool_release.json" \
        ${POOL_RELEASE_ARGS:-}
    ;;
bench_smoke)  # every GPU bench script once, small (after a change to their flags): rc 0 each, nothing timed
    RC[bench_smoke]=0
    smoke() {  # smoke NAME LIMIT ARGS...: bench/NAME.py ARGS
        local name=$1 limit=$2; shift 2
        run "smoke_$name" "$limit" python3 "bench/$name.py" "$@"
        RC[bench_smoke]=$(( RC[bench_smoke] | RC[smoke_$name] ))
    }
    smoke bench_nvidia 60 --vllm-ops --replays 3 --vllm-ops-misses 0,34 --vllm-ops-batches 1,8 --vllm-ops-rows 1
    smoke bench_triton 90 --replays 3 --cells 34:8
    smoke bench_pool_release 60 --gib 1 --chunk-gib 0.5
    smoke bench_host_reads 40 --reps 2 --steps 2
    smoke bench_engine_host 60 --batch 4 --context 4096 --warmup 1 --steps 3
    smoke bench_indexer_split 60 --batch 2 --context 4096 --parts 1,2 --replays 2
    smoke bench_transformers 60 --layers 2 --batches 1 --contexts 4096 --steps 2 --warmup 1
    smoke bench_serving 60 --layers 2 --contexts 4096 --batches 1 --steps 2 --warmup 1 --seed 3 --modes hisparse,all-resident
    smoke bench_assisted 60 --contexts 2048 --batches 1 --new 8 --layers 2
    smoke bench_tp_shared 60 --quick --parts a --devices 0,0
    smoke bench_locality 90 --no-policies --backend nvidia --top-k 512 --requests 4 --steps 8 --warmup 2
    ;;
*)
    echo "unknown stage $stage" ;;
esac
done

echo
echo "==================== summary ===================="
for stage in $STAGES; do
    echo "$stage: rc=${RC[$stage]:-not run}"
done
for name in $(printf '%s\n' "${!RC[@]}" | grep '^smoke_' | sort); do
    echo "  $name: rc=${RC[$name]}"; [ "${RC[$name]}" = 0 ] || tail -5 "$OUT/$name.log"
done
[ -f "$OUT/readme.log" ] && { echo "--- readme"; grep -E "^(--- |FAILED|compare_runs)|selected:|  backend |steps per second|hit rate|attention check" "$OUT/readme.log" | tail -40; }
for stage in tests tests_variants conformance memcheck racecheck tf_tests triton triton_tests triton_conformance triton_conformance_env vllm_tests memcheck_vllm_ops racecheck_vllm_ops; do
    [ -f "$OUT/$stage.log" ] || continue
    echo "--- $stage (tail)"
    grep -E "passed|failed|error|ERROR SUMMARY|RACECHECK SUMMARY|Error|FAILED" "$OUT/$stage.log" | tail -8
done
[ -f "$OUT/bench.log" ] && { echo "--- bench"; tail -20 "$OUT/bench.log"; }
for stage in triton_bench vllm_ops_bench serving; do
    [ -f "$OUT/$stage.log" ] && { echo "--- $stage (tail)"; tail -${SUMMARY_LINES:-30} "$OUT/$stage.log"; }
done
[ -f "$OUT/pool_release.log" ] && { echo "--- pool_release"; tail -9 "$OUT/pool_release.log"; }
[ -f "$OUT/tf_generate.log" ] && { echo "--- tf_generate"; grep -E "decode|hit rate|first batch|second batch|result|error" "$OUT/tf_generate.log"; }
[ -f "$OUT/tf_bench.log" ] && { echo "--- tf_bench"; tail -9 "$OUT/tf_bench.log"; }
[ -f "$OUT/tp_shared.log" ] && { echo "--- tp_shared"; grep -E "^(device mapping|PASS|FAIL)|^  FAIL" "$OUT/tp_shared.log" | tail -20; }
exit 0
