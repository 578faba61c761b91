#!/usr/bin/env bash
# The device run: dense against routed with the real SGLang 0.5.21 on one GPU, in stages of under nine minutes.
#
#   benchmarks/gpu/run.sh install|tiles|sweep|ladder|headline|kernels|clock|all|lease-1..lease-6|pack OUTDIR
#                         [--dry-run] [--within SECONDS] [--earlier DIR]... [--pack FILE] [--stand-in-ops OPS]
#                         [--samples] [--prefill-only] [--routed-prefill-graphs] [--routed-prefill-read READ]
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
# clock     always-route, the s = 0 control and dense each alone with its part clock on: a prefill pass's host
#           time by layer kind and part beside the device's span (where the routed prefill's host time goes)
# all       each in that order, then OUTDIR/results.json and OUTDIR/summary.md
# lease-N   the stages (and headline arms) of one device lease (`run.py leases`; benchmarks/gpu/README.md), in
#           order, then the summary: what one lease of device time measures
# pack      OUTDIR as one .tar.gz (--pack FILE), to keep or to carry into a later call
#
# --within S    this call's stages share S seconds: each stage's budget and limit shrink to what is left (less 45 s
#               to stop a stage, write the summary and pack), and a stage with under 140 s left is not started
# --earlier DIR an earlier run's results on the same GPU (repeatable): its tile table, tau and Q* serve where this
#               run has none of its own (a lease that does not tune, sweep or climb)
# --pack FILE   after the stages, OUTDIR packed into FILE (also when a stage stopped or failed)
# --stand-in-ops OPS  every server's RMSNorm, SiLU-and-mul and RoPE on the CUDA stand-ins: torch (SGLang's paths, the
#               default) or triton (`vskipper serve --stand-in-ops`); OUTDIR measures on one, and an --earlier run
#               serves only where it measured on the same
# --samples     every sweep server samples its forward's Python stack while a pass runs (VSKIPPER_STACK_SAMPLES;
#               a few percent of a pass): the summary says by line where each arm's prefill passes spent the host
# --prefill-only  the sweep serves its prefill lengths and rounds alone, no decode cell (so no tau): a routed
#               prefill's cost against dense's in about half a sweep's device time
# --routed-prefill-graphs  the sweep's routed arms replay each routed layer's prefill work from CUDA graphs captured
#               at the sweep's prefill token counts (VSKIPPER_PREFILL_GRAPHS; with the backend read, the read eager
#               between), the headline's routed arms at the counts "auto" asks that their prefill chunk reaches:
#               not on a dry run
# --routed-prefill-read READ  the sweep's and the headline's routed arms prefill with the packed or the backend read
#               in place of the table's choice (VSKIPPER_PREFILL_READ): the triton execution's, not on a dry run
#
# A stage stopped by its budget or limit runs again while the call has time (up to three runs; a failed one does
# not, nor one whose budget a lease caps): in a lease, in `all`, and named alone with --within (without it, a stage
# named alone runs once: three runs could outlast a device call).
# Every stage installs what a fresh machine lacks first and skips what OUTDIR already holds, so any stage can be
# rerun alone. Each runs under `timeout` ($VSKIPPER_STAGE_LIMIT_S, 530 s) and stops starting work at its budget
# ($VSKIPPER_STAGE_BUDGET_S, 450 s). --dry-run: the same steps on the CPU platform with a tiny model (the local
# environment instead of the bundle); its numbers mean nothing.
set -euo pipefail

usage() {
    echo "usage: $0 install|tiles|sweep|ladder|headline|kernels|clock|all|lease-N|pack OUTDIR [--dry-run]" \
         "[--within SECONDS] [--earlier DIR]... [--pack FILE] [--stand-in-ops torch|triton] [--samples]" \
         "[--prefill-only] [--routed-prefill-graphs] [--routed-prefill-read packed|backend]" >&2
    exit 2
}
[ $# -ge 2 ] || usage
CALL="$0 $*"  # what a stopped call reruns
STAGE=$1 OUT=$2 DRY="" WITHIN="" PACK="" EARLIER="" OPS=torch SAMPLES=0 PREFILL_ONLY=0 ROUTED_GRAPHS=0 ROUTED_READ=""
shift 2
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY="--dry-run"; shift ;;
        --within) [ $# -ge 2 ] && [[ $2 =~ ^[0-9]+$ ]] || { echo "--within: a whole number of seconds" >&2; usage; }
                  WITHIN=$2; shift 2 ;;
        --earlier) [ $# -ge 2 ] && [ -d "$2" ] || { echo "--earlier: ${2:-}: no such folder" >&2; usage; }
                   EARLIER="${EARLIER:+$EARLIER:}$(cd "$2" && pwd)"; shift 2 ;;
        --pack) [ $# -ge 2 ] || usage; PACK=$2; shift 2 ;;
        --stand-in-ops) [ $# -ge 2 ] && [[ $2 =~ ^(torch|triton)$ ]] || { echo "--stand-in-ops: torch or triton" >&2; usage; }
                        OPS=$2; shift 2 ;;
        --samples) SAMPLES=1; shift ;;
        --prefill-only) PREFILL_ONLY=1; shift ;;
        --routed-prefill-graphs) ROUTED_GRAPHS=1; shift ;;
        --routed-prefill-read) [ $# -ge 2 ] && [[ $2 =~ ^(packed|backend)$ ]] || { echo "--routed-prefill-read: packed or backend" >&2; usage; }
                               ROUTED_READ=$2; shift 2 ;;
        *) usage ;;
    esac
done
case $STAGE in install|tiles|sweep|ladder|headline|kernels|clock|all|pack|lease-[0-9]*) ;; *) usage ;; esac
[ "$STAGE" != pack ] || [ -n "$PACK" ] || { echo "pack: --pack FILE names the archive" >&2; usage; }
[ -z "$DRY" ] || [ "$OPS" = torch ] || { echo "--stand-in-ops $OPS: the CUDA stand-ins', not a CPU dry run's" >&2; exit 2; }
[ -z "$DRY" ] || [ "$ROUTED_GRAPHS" = 0 ] || { echo "--routed-prefill-graphs: CUDA graphs, not a CPU dry run's" >&2; exit 2; }
[ -z "$DRY" ] || [ -z "$ROUTED_READ" ] || { echo "--routed-prefill-read: the triton execution's, not a CPU dry run's" >&2; exit 2; }
START_S=$SECONDS
[ -z "$PACK" ] || PACK=$(cd "$(dirname "$PACK")" && pwd)/$(basename "$PACK")
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
[ -z "$EARLIER" ] || export VSKIPPER_GPU_RUN_EARLIER="$EARLIER"
export VSKIPPER_GPU_RUN_STAND_IN_OPS=$OPS
export VSKIPPER_GPU_RUN_SAMPLES=$SAMPLES
export VSKIPPER_GPU_RUN_PREFILL_ONLY=$PREFILL_ONLY
export VSKIPPER_GPU_RUN_ROUTED_PREFILL_GRAPHS=$ROUTED_GRAPHS
export VSKIPPER_GPU_RUN_ROUTED_PREFILL_READ=$ROUTED_READ
# What a --within call keeps at its end: a stage's 30 s to stop after TERM, then the summary and the pack.
END_MARGIN_S=${VSKIPPER_END_MARGIN_S:-45}
MIN_STAGE_S=140  # a stage with less than this left of --within is not started (its budget would be under 60 s)

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
import json, os, sys, platform
import torch, triton
out, gpu, memory, driver, mode = sys.argv[1:6]
env = {"gpu": gpu.strip(), "memory": memory.strip(), "driver": driver.strip(), "torch": torch.__version__,
       "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
       "cuda_available": torch.cuda.is_available(), "mode": mode,
       "stand_in_ops": os.environ["VSKIPPER_GPU_RUN_STAND_IN_OPS"]}
if os.path.isfile(out):  # a run's folder measures on one GPU in one mode on one kind of ops: its cells pair
    before = json.load(open(out))
    key = ("gpu", "mode", "stand_in_ops")
    was, now = [before.get(k, "torch" if k == "stand_in_ops" else None) for k in key], [env[k] for k in key]
    if was != now:
        print(f"[install] {os.path.dirname(out)} holds a run on {was[0]} ({was[1]}, stand-in ops {was[2]}), "
              f"this one is on {now[0]} ({now[1]}, stand-in ops {now[2]}): start a new OUTDIR and give this one "
              "as --earlier", file=sys.stderr)
        sys.exit(2)
open(out, "w").write(json.dumps(env, indent=1) + "\n")
print("[install] " + ", ".join(f"{k} {v}" for k, v in env.items()))
PYEOF
}

# stage NAME [CAP [ARMS]]: one stage under its limit and budget, both cut to what is left of --within (less the
# end margin) and the budget to CAP where one is given (0: none); ARMS, the headline's arms to serve.
stage() {
    local rc=0 limit=$LIMIT_S budget=$BUDGET_S cap=${2:-0} arms=${3:-}
    if [ -n "$WITHIN" ]; then
        local left=$(( WITHIN - (SECONDS - START_S) - END_MARGIN_S ))
        if [ "$left" -lt "$MIN_STAGE_S" ]; then
            echo "[$1] not started: under ${MIN_STAGE_S} s left of --within $WITHIN (${END_MARGIN_S} s kept for the end)"
            return 4
        fi
        [ "$left" -ge "$limit" ] || limit=$left
        budget=$(( limit - (LIMIT_S - BUDGET_S) ))  # the limit's margin over the budget kept
        [ "$budget" -ge 30 ] || budget=30
    fi
    if [ "$cap" -gt 0 ] && [ "$budget" -gt "$cap" ]; then
        limit=$(( limit - budget + cap )); budget=$cap
    fi
    timeout --signal=TERM --kill-after=30 "$limit" "$PY" benchmarks/gpu/run.py "$1" "$OUT" $DRY \
        --budget-s "$budget" --limit-s "$limit" ${arms:+--arms "$arms"} < /dev/null || rc=$?
    case $rc in
        0) ;;
        4) echo "[$1] time budget reached: rerun '$CALL' to finish it"; return 4 ;;
        5) echo "[$1] what is left does not fit this call's time: rerun '$CALL' to finish it"; return 5 ;;
        124|137|143) echo "[$1] stopped at its ${limit} s limit: rerun '$CALL'"; return $rc ;;
        *) echo "[$1] failed with exit $rc"; return $rc ;;
    esac
}

# A stage that reached its budget (exit 4) or its limit runs again to finish what it left (each skips what is
# done), up to three runs, where --within leaves it time; a failed one does not, nor one whose budget a lease
# caps (the cap bounds all its runs: the tuner would start again), nor one that left work and could start none
# of it (exit 5: a rerun has less time still). Returns the last run's code.
stage_runs() {
    local rc=0
    for _ in 1 2 3; do
        rc=0
        stage "$@" || rc=$?
        case $rc in 4|124|137|143) [ "${2:-0}" = 0 ] || break
                                   [ -z "$WITHIN" ] || [ $(( WITHIN - (SECONDS - START_S) - END_MARGIN_S )) \
                                                           -ge "$MIN_STAGE_S" ] || break ;;
                    *) break ;; esac
    done
    return $rc
}

# pack [quiet]: OUTDIR into --pack's archive, whole or not at all: a part file of its own, moved in place once tar
# is done (a file that grew while tar read it, a server's log, is kept as tar found it: tar's exit 1). At the
# lowest priority: it may run beside a timed cell.
pack() {
    [ -n "$PACK" ] || return 0
    local part="$PACK.part.$BASHPID" rc=0
    nice -n 19 tar -czf "$part" --warning=no-file-changed -C "$(dirname "$OUT")" "$(basename "$OUT")" || rc=$?
    [ "$rc" -le 1 ] || { rm -f "$part"; return 1; }
    mv -f "$part" "$PACK"
    [ "${1:-}" = quiet ] || echo "[pack] $OUT -> $PACK ($(du -h "$PACK" | cut -f1))"
}

if [ "$STAGE" = pack ]; then pack; exit 0; fi
# While the stages run, what they have written is packed every PACK_EVERY_S: a call cut short from outside (a
# device's time running out before --within's) keeps what it served up to then. One packer at a time: the packs
# after each stage and at the end stop it first, so no older pack lands after a newer one.
PACK_EVERY_S=${VSKIPPER_PACK_EVERY_S:-60}
[[ $PACK_EVERY_S =~ ^[1-9][0-9]*$ ]] || { echo "VSKIPPER_PACK_EVERY_S: a whole number of seconds, 1 or more" >&2; exit 2; }
PACKER=
start_packer() {  # it ends with this script, however the script ends (a KILL too: it looks before each pack)
    [ -n "$PACK" ] || return 0
    ( nap=; trap '[ -z "$nap" ] || kill "$nap" 2>/dev/null; exit 0' TERM
      while :; do
          sleep "$PACK_EVERY_S" & nap=$!; wait "$nap"; nap=
          kill -0 $$ 2>/dev/null || exit 0
          pack quiet || true
      done ) > /dev/null 2>&1 &
    PACKER=$!
}
stop_packer() {  # its pack in flight ends first; nothing of it holds the call's output open after
    [ -z "$PACKER" ] || { kill "$PACKER" 2>/dev/null || true; wait "$PACKER" 2>/dev/null || true; PACKER=; }
}
trap stop_packer EXIT
start_packer
install
RC=0
case $STAGE in
    install) ;;
    all) for s in $("$PY" benchmarks/gpu/run.py stages "$OUT"); do
             stage_runs "$s" || RC=$?
             stop_packer; pack || RC=$?; start_packer  # each stage kept as it ends
         done
         "$PY" benchmarks/gpu/run.py summary "$OUT" $DRY || RC=$? ;;
    lease-*) lines=$("$PY" benchmarks/gpu/run.py leases "$OUT" | awk -v l="$STAGE" '$1 == l')
             [ -n "$lines" ] || { echo "$STAGE: no such lease (run.py leases)" >&2; exit 2; }
             while read -r _ s cap arms; do
                 [ "$arms" != - ] || arms=""
                 rc=0
                 stage_runs "$s" "$cap" "$arms" || rc=$?
                 [ $rc = 0 ] || RC=$rc
                 stop_packer; pack || RC=$?; start_packer
                 # a stage that failed leaves what depends on it undone; one left by the time does too. Nothing
                 # needs the tiles stage: a server without its table takes the one shipped for the device
                 case $rc in 0) ;; *) [ "$s" = tiles ] || break ;; esac
             done <<< "$lines"
             "$PY" benchmarks/gpu/run.py summary "$OUT" $DRY || RC=$? ;;
    *) if [ -n "$WITHIN" ]; then stage_runs "$STAGE" || RC=$?; else stage "$STAGE" || RC=$?; fi ;;
esac
stop_packer
[ -z "$PACK" ] || rm -f "$PACK".part.*
pack || RC=$?
# A stage stopped at its limit, or one that could start none of what it left, left work for a later call, as one
# stopped by its budget: exit 4 (a caller's own timeout reads 124 and 137 as this call's own).
case $RC in 5|124|137|143) RC=4 ;; esac
echo "[run] $STAGE done in $(( SECONDS - START_S )) s (exit $RC)"
exit $RC
