#!/usr/bin/env bash
# One device call: correctness stages of scripts/gpu_validate.sh side by side (they share the GPU
# but time nothing), then the timed stages one after the other on an otherwise idle machine.
# Logs of every stage are packed into $OUT/logs.tgz (the device returns at most 8 files); the
# files named in KEEP (globs under the stage folders) are copied to $OUT as well.
#
#   OUT=... PAR="tests triton tf_tests" SEQ="serving vllm_ops_bench" bash scripts/gpu_call.sh
#   git archive REV backends/nvidia | tar -x -C .before; OUT=... SEQ="before:bench bench" bash scripts/gpu_call.sh
#   git archive REV backends/nvidia plugins/transformers | tar -x -C .before; ... SEQ="before:serving_locality serving_locality"
#
# Carried wheels in .whl/ (transformers 5.24 and regex, for instance) are installed into
# /tmp/site first and put on PYTHONPATH; the stages' own variables (T_*, *_ARGS) pass through.
set -u
cd "$(dirname "$0")/.."
FINAL=${OUT:?OUT must name the folder that comes back}
WORK=/tmp/gpu_call
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    python3 -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
fi
t0=$SECONDS
pids=()
for stage in ${PAR:-}; do
    OUT=$WORK/$stage bash scripts/gpu_validate.sh "$stage" > "$WORK/$stage.summary" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "=== side by side: ${PAR:-none} in $((SECONDS - t0)) s"
for stage in ${PAR:-}; do sed -n '/==== summary ====/,$p' "$WORK/$stage.summary"; done
# A stage's folder under $WORK: NAME, or NAME2, NAME3, ... where a stage is named twice (a second sample).
fresh_dir() {
    local dir=$1 n=1
    while [ -e "$WORK/$dir" ]; do n=$((n + 1)); dir=$1$n; done
    echo "$dir"
}
for item in ${SEQ:-}; do
    # "before:STAGE": the stage on the backends/nvidia (and, where .before/ has it, the
    # plugins/transformers) of the tree under .before/ (git archive of an earlier commit), with
    # BENCH_BEFORE_ARGS for its bench arguments.
    stage=${item#before:}
    if [ "$stage" != "$item" ]; then
        tf_root=$PWD
        [ -d .before/plugins/transformers/hisparse_transformers ] && tf_root=$PWD/.before
        dir=$(fresh_dir "before_$stage")
        NVIDIA_ROOT=$PWD/.before TRANSFORMERS_ROOT=$tf_root BENCH_ARGS=${BENCH_BEFORE_ARGS:-${BENCH_ARGS:-}} \
            OUT=$WORK/$dir bash scripts/gpu_validate.sh "$stage" > "$WORK/$dir.summary" 2>&1
    else
        dir=$(fresh_dir "$stage")
        OUT=$WORK/$dir bash scripts/gpu_validate.sh "$stage" > "$WORK/$dir.summary" 2>&1
    fi
    sed -n '/==== summary ====/,$p' "$WORK/$dir.summary"
done
echo "=== all in $((SECONDS - t0)) s"
tar czf "$FINAL/logs.tgz" -C "$WORK" .
for pattern in ${KEEP:-}; do
    for f in $WORK/$pattern; do [ -f "$f" ] && cp "$f" "$FINAL/"; done
done
ls -la "$FINAL"
