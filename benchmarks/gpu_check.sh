#!/usr/bin/env bash
# The GPU check (issue 10, sections 1 and 4): one script, about 7.5 minutes of one card.
#
# The device machine has a CUDA build of torch in its python3, no .venv, no Ray and
# no package registry. Ray travels as wheels in two folders, one per device call
# (/work/shared/gpu/ray-wheels.sh):
#
#   here, once:    mkdir -p .git/info && bash ../shared/gpu/ray-wheels.sh fetch
#                  (fills .gpu-a, 41 MB, and .gpu-b, 39 MB, both git-ignored)
#   device call 1, carry [".gpu-a"], timeout_s 60:
#                  rm -rf /tmp/gpu-a && cp -r .gpu-a /tmp/gpu-a
#   device call 2, at once (a machine left idle goes back, /tmp with it), carry [".gpu-b"], timeout_s 560:
#                  bash .gpu-b/ray-wheels.sh unpack /tmp/gpu-a .gpu-b /tmp/site && export PYTHONPATH=/tmp/site:. && ARCHIVE=$OUT/gpu_check.tgz OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh
#
# The device tool returns at most 8 files from $OUT, so the run writes into /tmp/gpu_check and
# packs it into $OUT/gpu_check.tgz after every part (ARCHIVE): a run cut short still returns what
# finished. Unpack it into benchmarks/reported/gpu/, and
# `python3 benchmarks/gpu_summary.py benchmarks/reported/gpu` prints the figures again.
#
# Parts, in order of priority; each writes its JSON as soon as it has a figure (and
# again after every run), and each is cut at min(its cap, what is left of BUDGET_S),
# so a run that is cut short keeps what finished:
#   1. cnn    64 CIFAR-sized CNNs (cifar-cnn3, 50k/10k), plain Tune at 1/4, 1/8 and 1/16
#             of the card per trial (reuse_actors, data made once per trial process; the
#             row's (a) is the fastest share) vs chorus_tune (defaults, the Tune way: a
#             stop dict, no max_iterations), FIFO 2 epochs, then ASHA / ChorusASHA max_t 4:
#             vs_tune-cnn.json
#   2. mlp    the same with 64 MLPs (tab-mlp2, 50k/10k): vs_tune-mlp.json
#   2b. asha128  128 MLPs under ASHA / ChorusASHA: vs_tune-mlp-asha128.json
#   2c. widths   issue 41's width grid (4 widths x 2 lrs x 4 wds, two-hidden-layer module), FIFO:
#             vs_tune-widths.json
#   3. share  3 widths x 16 lrs of the CNN, 1 epoch, chorus_tune with 1, 0.5, 0.25 GPU
#             per bucket (1, 2, 4 buckets on the card): share_card.json
#   4. step   fused step vs K eager steps, fp32 and bf16: fused_step.json;
#             then fp32 vs the compiled route, also against compiled eager models:
#             fused_step_compiled.json
# Every timed run waits first until the cluster is free again (buckets hold their GPU
# until idle_close_s after their last read), each way gets WARMUP discarded runs, and
# REPEATS timed ones follow, interleaved with the order rotated (benchmarks/vs_tune.py).
# With the defaults (3 repeats, a warm-up, 3 plain shares) parts 1 and 2 run 26 sweeps
# each, not 4 as before: raise BUDGET_S and the caps, or lower REPEATS/FRACTIONS, to
# fit the card's time; a part cut at its cap keeps the repeats that finished.
#
# Settings (environment): PY (python3), OUT (benchmarks/results/gpu_check), BUDGET_S (450; smoke 1500),
# FRACTIONS (plain Tune's card shares, 0.25,0.125,0.0625; smoke 0.25,0.125), REPEATS (3; smoke 1),
# ARCHIVE (a .tgz of OUT, rewritten after every part; none when unset), WARMUP (1), SCHEDULERS (fifo,asha: those of parts cnn and mlp), PARTS (cnn,mlp,asha128,widths,share,step,compiled: the parts to run),
# STEP_MODELS (mlp256,cnn3: part step's models, in order), CAP_CNN, CAP_MLP, CAP_SHARE,
# CAP_STEP, CAP_COMPILED, CAP_ASHA128, CAP_WIDTHS (each part's cap, s), SMOKE=1: every path at toy sizes on whatever device
# torch sees (a CPU here: SMOKE=1 PY=.venv/bin/python OUT=/tmp/gpu-smoke bash benchmarks/gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # absolute: Tune's trial actors change directory
export PYTHONUNBUFFERED=1 RAY_ADDRESS=local
PY=${PY:-python3}
OUT=${OUT:-benchmarks/results/gpu_check}
SMOKE=${SMOKE:-0}
WARMUP=${WARMUP:-1}
PARTS=${PARTS:-cnn,mlp,asha128,widths,share,step,compiled}
SCHEDULERS=${SCHEDULERS:-fifo,asha}  # parts cnn and mlp
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

if [ "$SMOKE" = 1 ]; then
  # Toy sizes: every code path, on whatever device torch sees; nothing here is a result.
  SIZE="--n-train 256 --n-val 64"; TRIALS=4; EPOCHS=1; ASHA_EPOCHS=2; BATCH=64; WAY_BUDGET=150
  SHARE="--widths 4,8 --lrs 2 --epochs 1 --batch-size 64 --n-train 256 --n-val 64"
  STEP="--models mlp64,cnn3 --ks 2 --steps 3 --repeats 1"; STEP_COMPILED="--models mlp64 --ks 2 --steps 3 --repeats 1"
  CAP_CNN=${CAP_CNN:-500} CAP_MLP=${CAP_MLP:-400} CAP_SHARE=${CAP_SHARE:-400} CAP_STEP=${CAP_STEP:-200}
  CAP_COMPILED=${CAP_COMPILED:-400} CAP_ASHA128=${CAP_ASHA128:-400} CAP_WIDTHS=${CAP_WIDTHS:-400}; TRIALS_ASHA=8
  FRACTIONS=${FRACTIONS:-0.25,0.125}; REPEATS=${REPEATS:-1}
  DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
  BUDGET_S=${BUDGET_S:-1500}
else
  SIZE=""; TRIALS=64; EPOCHS=2; ASHA_EPOCHS=4; BATCH=256; WAY_BUDGET=${WAY_BUDGET:-60}
  SHARE="--widths 8,16,32 --lrs 16 --epochs 1 --batch-size 256"
  STEP="--models ${STEP_MODELS:-mlp256,cnn3} --ks 16,64 --steps 40 --repeats 2"
  STEP_COMPILED="--models mlp256,cnn3 --ks 64 --steps 40 --repeats 2"
  CAP_CNN=${CAP_CNN:-260} CAP_MLP=${CAP_MLP:-100} CAP_SHARE=${CAP_SHARE:-80} CAP_STEP=${CAP_STEP:-45}
  CAP_COMPILED=${CAP_COMPILED:-60} CAP_ASHA128=${CAP_ASHA128:-70} CAP_WIDTHS=${CAP_WIDTHS:-50}; TRIALS_ASHA=128
  FRACTIONS=${FRACTIONS:-0.25,0.125,0.0625}; REPEATS=${REPEATS:-3}
  DEVICE=cuda
  BUDGET_S=${BUDGET_S:-450}
fi

start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }

# part NAME CAP CMD...: run CMD under min(CAP, time left), its output in $OUT/NAME.txt;
# print its elapsed time and the tail of its output. A part not named in PARTS is skipped.
part() {
  local name=$1 cap=$2; shift 2
  case ",$PARTS," in *",$name,"*) ;; *) echo "== $name: not in PARTS ($PARTS)"; return;; esac
  local t; t=$(left); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 20 ]; then echo "== $name: skipped, $(left) s of BUDGET_S left"; return; fi
  echo "== $name (at most $t s): $*"
  local p0 rc; p0=$(date +%s)
  timeout -k 20 "$t" "$@" > "$OUT/$name.txt" 2>&1; rc=$?
  grep -v '^\[20\|^(raylet\|^[│╭╰├]\|^View detailed\|^To visualize\|^$' "$OUT/$name.txt" | tail -n 14
  echo "== $name: rc=$rc, $(( $(date +%s) - p0 )) s (total $(( $(date +%s) - start )) s)"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "== $name: cut at $t s; its JSON holds what finished"
    # A killed driver leaves no Ray behind (its node processes share its fate); on the
    # device machine, make sure before the next part. Never on a shared machine.
    [ "$SMOKE" = 1 ] || $PY -c "import sys; from ray.scripts.scripts import main; sys.argv = ['ray', 'stop', '--force']; main()" >/dev/null 2>&1 || true
  fi
  pack
}

# pack: OUT as one archive (ARCHIVE), after every part and at the end.
pack() {
  if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE.tmp" -C "$OUT" . && mv "$ARCHIVE.tmp" "$ARCHIVE"; fi
}

echo "== env (SMOKE=$SMOKE, device=$DEVICE, budget ${BUDGET_S} s, out $OUT)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY - <<EOF | tee "$OUT/env.txt"
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
if "$DEVICE" == "cuda":
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { echo "== env: torch cannot run on $DEVICE; stopping"; exit 1; }
# What Ray Tune imports unconditionally; a missing one belongs in ray-wheels.sh's DEPS.
$PY - <<'PYEOF' | tee -a "$OUT/env.txt"
import importlib.util
missing = []
for name in ("numpy", "pandas", "pyarrow", "fsspec", "requests", "click", "filelock", "msgpack",
             "google.protobuf", "yaml", "jsonschema", "pydantic", "tensorboardX", "ray"):
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        missing.append(name)
print("modules missing:", ", ".join(missing) or "none")
PYEOF
ray_ok=1
$PY -c "import ray, ray.tune; print('ray', ray.__version__)" || { ray_ok=0; echo "== env: no Ray (PYTHONPATH=/tmp/site? see the top of this script): only the fused step runs"; }

VS="$PY benchmarks/vs_tune.py --device $DEVICE --trials $TRIALS --epochs $EPOCHS --asha-epochs $ASHA_EPOCHS
    --batch-size $BATCH --ways plain,chorus --repeats $REPEATS --warmup $WARMUP
    --gpu-fraction $FRACTIONS --way-budget-s $WAY_BUDGET --out $OUT $SIZE"
if [ "$ray_ok" = 1 ]; then
  part cnn "$CAP_CNN" $VS --scheduler "$SCHEDULERS" --workload cifar-cnn3 --name vs_tune-cnn
  part mlp "$CAP_MLP" $VS --scheduler "$SCHEDULERS" --workload tab-mlp2 --name vs_tune-mlp
  # Issue 43: ASHA at the size users run (128 MLPs), and the 4-width sweep (issue 41's grid, 32 trials).
  VS_ONE="$VS --trials $TRIALS_ASHA"
  part asha128 "$CAP_ASHA128" $VS_ONE --scheduler asha --workload tab-mlp2 --name vs_tune-mlp-asha128
  part widths "$CAP_WIDTHS" $VS_ONE --scheduler fifo --workload tab-widths --name vs_tune-widths
  part share "$CAP_SHARE" $PY benchmarks/share_card.py --device "$DEVICE" --workload cifar-cnn3 $SHARE \
      --repeats "$REPEATS" --warmup "$WARMUP" --way-budget-s "$WAY_BUDGET" --out "$OUT" --name share_card
fi
part step "$CAP_STEP" $PY benchmarks/fused_step.py --device "$DEVICE" $STEP --variants fp32,bf16 --json "$OUT/fused_step.json"
part compiled "$CAP_COMPILED" $PY benchmarks/fused_step.py --device "$DEVICE" $STEP_COMPILED --variants fp32,fp32:compiled \
    --compiled-eager --json "$OUT/fused_step_compiled.json"

echo "== summary ($(( $(date +%s) - start )) s)"
$PY benchmarks/gpu_summary.py "$OUT" || true
pack
