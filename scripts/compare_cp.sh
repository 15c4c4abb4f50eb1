#!/usr/bin/env bash
# Train one config at CP=N and at CP=1 (same seed, same data, fp32, same world size) and
# compare their loss curves with tools/compare_loss_curves.py. Exit status = the tool's:
# 0 the curves agree within TOLERANCE, 1 they do not, 2 bad input; a failed training run
# exits with its own non-zero status before any comparison.
#
#   scripts/compare_cp.sh CONFIG.yaml CP [pretrain_moe.py flags for both runs...]
#   scripts/compare_cp.sh configs/cpu_demo.yaml 2                  # 4 CPU ranks: CP2xDP2 vs DP4
#   NPROC=2 scripts/compare_cp.sh configs/cpu_demo.yaml 2 --tensor-model-parallel-size 1 --train-iters 5
#
# Both runs use NPROC ranks (default: GPUs on the node, else 4), so DP = NPROC/(TP x PP x CP)
# takes up what CP gives back: the global batch, the experts' grid and every other flag stay
# the same. The config is copied with bf16 switched off (fp32), so CP=N matches CP=1 up to
# float32 rounding; TOLERANCE (default 1e-5) is the max relative loss difference allowed.
#
# Environment: NPROC, TOLERANCE (1e-5), KEY (train/lm_loss), OUT_DIR (runs/compare_cp-<config>-cp<N>),
# PLOT (1: write OUT_DIR/loss_curves.png when matplotlib is installed; 0: no plot).
# NPROC and CP must be whole numbers (NPROC >= 1, CP >= 2), checked before any arithmetic
# (scripts/env_checks.sh): anything else exits 2 before a run starts. Empty NPROC = unset.
# Per-run logs: OUT_DIR/cp<N>/ and OUT_DIR/cp1/ (metrics.jsonl, config.yaml, train.log).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env_checks.sh"

if [[ $# -lt 2 ]]; then
    echo "usage: $0 CONFIG.yaml CP [pretrain_moe.py flags...]" >&2
    exit 2
fi
config="$1" CP="$2"
shift 2
# Paths given relative to the caller's directory stay valid after the cd to the repository.
[[ -f "$config" ]] && config="$(realpath "$config")"
[[ -n "${OUT_DIR:-}" ]] && OUT_DIR="$(realpath -m "$OUT_DIR")"
cd "$(dirname "$0")/.."
if [[ ! -f "$config" ]]; then
    echo "error: config $config: no such file" >&2
    exit 2
fi
cp_ext_int CP "" 2 "" "the second argument is the context-parallel size to compare with CP=1, e.g. 2"
cp="$CP"

python="${PYTHON:-python3}"
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"
fi
cp_ext_int NPROC "$([[ "$gpus" -gt 0 ]] && echo "$gpus" || echo 4)" 1 "" \
    "set it to the ranks of each run (e.g. NPROC=4) or unset it (GPUs on the node, else 4)"
nproc="$NPROC"
tolerance="${TOLERANCE:-1e-5}"
key="${KEY:-train/lm_loss}"
out="${OUT_DIR:-runs/compare_cp-$(basename "${config%.*}")-cp${cp}}"
mkdir -p "$out"
if [[ "$gpus" -gt 0 ]]; then
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# fp32 copy of the config: bf16 is a store_true flag, so it can only be switched off here.
fp32_config="$out/config_fp32.yaml"
"$python" - "$config" "$fp32_config" <<'PY'
import sys, yaml
src, dst = sys.argv[1:]
cfg = yaml.safe_load(open(src)) or {}
for k in ("bf16", "fp16"):
    cfg.pop(k, None)
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
PY

run() {  # run CP_SIZE [flags...]: train into $out/cp$CP_SIZE, keep its log there
    local size="$1" dir="$out/cp$1"
    shift
    rm -rf "$dir"
    mkdir -p "$dir"
    echo "=== CP=$size on $nproc ranks -> $dir" >&2
    local status=0
    "$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
        pretrain_moe.py --config "$fp32_config" "$@" --context-parallel-size "$size" --log-dir "$dir" \
        >"$dir/train.log" 2>&1 || status=$?
    grep -E "^ iteration |^training" "$dir/train.log" >&2 || true
    if [[ $status -ne 0 ]]; then
        echo "error: the CP=$size run failed (exit $status); last lines of $dir/train.log:" >&2
        tail -n 30 "$dir/train.log" >&2
        exit "$status"
    fi
}
# Check both grids before starting any rank: a bad flag is one clear message, not a torchrun trace.
for size in "$cp" 1; do
    WORLD_SIZE="$nproc" RANK=0 "$python" -c 'import sys; from cp_ext.arguments import parse_args_or_exit; parse_args_or_exit(sys.argv[1:])' \
        --config "$fp32_config" "$@" --context-parallel-size "$size" --log-dir "$out/cp$size" \
        || { echo "error: the CP=$size run's configuration is invalid on $nproc ranks (see above)" >&2; exit 2; }
done
run "$cp" "$@"
run 1 "$@"

plot_flags=()
if [[ "${PLOT:-1}" == 1 ]]; then
    if "$python" -c "import matplotlib" 2>/dev/null; then
        plot_flags=(--plot "$out/loss_curves.png")
    else
        echo "note: matplotlib is not installed; no plot (pip install matplotlib)" >&2
    fi
fi
status=0
"$python" tools/compare_loss_curves.py "$out/cp$cp" "$out/cp1" --key "$key" --tolerance "$tolerance" \
    "${plot_flags[@]}" || status=$?
exit "$status"
