#!/usr/bin/env bash
# The device run: dense against routed with the real SGLang 0.5.21 on one GPU, in stages of under nine minutes.
#
#   benchmarks/gpu/run.sh install|tiles|sweep|ladder|headline|kernels|all OUTDIR [--dry-run]
#
# install   installs the bundle (.gpu-bundle/, `make gpu-bundle`) into $VSKIPPER_SITE unless it is there already,
#           and prints the GPU, its memory and driver, torch and triton (OUTDIR/env.json)
# tiles     `vskipper tune-tiles` for the device (OUTDIR/tiles/tile-table.json): every later server serves with it
# sweep     fixed-batch decode (batch x context) and prefill at 1k/2k/4k tokens, dense and routed: tau
#                                                                                     (benchmarks/gpu/run.py)
# ladder    dense alone on GSM8K-shaped load: upstream's Q* ladder, then dense's side of the headline cells
#           (0.75 / 0.95 / 1.25 x Q*, 3 paired repetitions)
# headline  each routed arm alone on the same cells (hybrid with the rule's thresholds; always-route and the
#           s = 0 control at the knee; then hybrid with the sweep's tau), each against dense with gates and
#           intervals
# kernels   benchmarks/mixed_depth_bench.py with the tuned tiles
# all       each in that order (a stage stopped by its budget or limit runs again, up to three runs; a failed
#           one does not), then OUTDIR/results.json and OUTDIR/summary.md
#
# Every stage installs what a fresh machine lacks first and skips what OUTDIR already holds, so any stage can be
# rerun alone. Each runs under `timeout` ($VSKIPPER_STAGE_LIMIT_S, 530 s) and stops starting work at its budget
# ($VSKIPPER_STAGE_BUDGET_S, 450 s). --dry-run: the same steps on the CPU platform with a tiny model (the local
# environment instead of the bundle); its numbers mean nothing.
set -euo pipefail

usage() { echo "usage: $0 install|tiles|sweep|ladder|headline|kernels|all OUTDIR [--dry-run]" >&2; exit 2; }
[ $# -ge 2 ] || usage
STAGE=$1 OUT=$2 DRY=""
[ "${3:-}" = "--dry-run" ] && DRY="--dry-run"
[ $# -le 3 ] || usage
case $STAGE in install|tiles|sweep|ladder|headline|kernels|all) ;; *) usage ;; esac

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUNDLE=${VSKIPPER_BUNDLE:-$ROOT/.gpu-bundle}
SITE=${VSKIPPER_SITE:-/tmp/vskipper-site}
LIMIT_S=${VSKIPPER_STAGE_LIMIT_S:-530}
BUDGET_S=${VSKIPPER_STAGE_BUDGET_S:-450}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"

if [ -n "$DRY" ]; then
    PY=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
else
    PY=${PYTHON:-python3}
    unset TRITON_INTERPRET
fi
export PYTHONUNBUFFERED=1

install() {
    if [ -n "$DRY" ]; then
        echo "[install] dry run: the local environment serves (no bundle installed)"
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    else
        "$PY" benchmarks/gpu/bundle.py verify --out "$BUNDLE"
        local stamp
        stamp=$(sha256sum "$BUNDLE/manifest.json" | cut -d' ' -f1)
        if [ "$(cat "$SITE/.bundle-manifest-sha256" 2>/dev/null)" = "$stamp" ]; then
            echo "[install] bundle already installed in $SITE"
        else
            rm -rf "$SITE"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
                "$BUNDLE"/wheels/*.whl
            echo "$stamp" > "$SITE/.bundle-manifest-sha256"
            echo "[install] bundle installed in $SITE"
        fi
        # The tree's code first, the bundle's packages (and vSkipper's SGLang plugin entry point) after it.
        export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
    local gpu="none" memory="" driver=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        IFS=, read -r gpu memory driver < <(nvidia-smi --query-gpu=name,memory.total,driver_version \
            --format=csv,noheader | head -1)
    fi
    "$PY" - "$OUT/env.json" "$gpu" "$memory" "$driver" "${DRY:-device}" <<'PYEOF'
import json, sys, platform
import torch, triton
out, gpu, memory, driver, mode = sys.argv[1:6]
env = {"gpu": gpu.strip(), "memory": memory.strip(), "driver": driver.strip(), "torch": torch.__version__,
       "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
       "cuda_available": torch.cuda.is_available(), "mode": mode}
open(out, "w").write(json.dumps(env, indent=1) + "\n")
print("[install] " + ", ".join(f"{k} {v}" for k, v in env.items()))
PYEOF
}

stage() {
    local rc=0
    timeout --signal=TERM --kill-after=30 "$LIMIT_S" "$PY" benchmarks/gpu/run.py "$1" "$OUT" $DRY \
        --budget-s "$BUDGET_S" || rc=$?
    case $rc in
        0) ;;
        4) echo "[$1] time budget reached: rerun '$0 $1 $OUT${DRY:+ $DRY}' to finish it"; return 4 ;;
        124|137|143) echo "[$1] stopped at its ${LIMIT_S} s limit: rerun '$0 $1 $OUT${DRY:+ $DRY}'"; return $rc ;;
        *) echo "[$1] failed with exit $rc"; return $rc ;;
    esac
}

install
case $STAGE in
    install) ;;
    all) for s in $("$PY" benchmarks/gpu/run.py stages "$OUT"); do
             # A stage that reached its budget (exit 4) or its limit runs again to finish what it left (each
             # skips what is done), up to three runs; a failed one does not.
             for _ in 1 2 3; do
                 rc=0
                 stage "$s" || rc=$?
                 case $rc in 4|124|137|143) ;; *) break ;; esac
             done
         done
         "$PY" benchmarks/gpu/run.py summary "$OUT" $DRY ;;
    *) stage "$STAGE" ;;
esac
