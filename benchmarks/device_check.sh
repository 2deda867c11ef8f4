#!/usr/bin/env bash
# Issue 17 point 4/5 on a machine with a GPU: prints the machine, the torch version, the private torch names
# adaptdist reaches that this torch lacks, then trains on the GPU and measures bench_recsys's GPU-only, CPU-only
# and heterogeneous samples/s. Under 4 minutes on one GPU and 16 cores; no network.
#
#   bash benchmarks/device_check.sh                          # from the repository root, on the GPU machine
#   DEVICE_CHECK_DEVICE=cpu bash benchmarks/device_check.sh  # dry run of the plumbing on a CPU-only machine
#
# What it needs there: python3 with its own torch (CUDA build); the wheels of adaptdist's dependencies in
# ./device_wheels (rich, markdown-it-py, mdurl, pygments, pyyaml, safetensors, numpy: fetched here by
# benchmarks/fetch_device_wheels.sh, ~20 MB, carried; torch's wheel does not bring numpy, safetensors' save_file
# needs it). OR-Tools is not needed: every run here names its plan
# (--plan dp, --mode async-hetero), and the planner imports OR-Tools only to solve an automatic plan.
# adaptdist itself runs from this checkout through PYTHONPATH (no `pip install -e .`: its build backend and the
# torch it pins for the build cannot be fetched offline). The C++ kernels (built against another torch) are
# skipped: ADAPTDIST_KERNELS=0, so every collective of the cpu ranks takes gloo.
#
# Every step runs under `timeout`; a failed step prints its status and the next one runs. Environment:
#   DEVICE_CHECK_DEVICE  cuda (default) or cpu: the device of the "GPU" rank (cpu: a dry run, with few steps)
#   DEVICE_CHECK_WHEELS  the wheel folder (default ./device_wheels)
#   DEVICE_CHECK_SCALE   multiplies every time limit (default 1; a slow dry run may need 4)
#   DEVICE_CHECK_OUT     where runs write (default a fresh temporary directory)
#   DEVICE_CHECK_PYTHON  the interpreter whose torch the venv reuses (default: the first of python3, python3.12,
#                        python that imports torch)
#   DEVICE_CHECK_BLOCK   module names made unimportable in every process (a dry run's stand-in for a machine
#                        without them, e.g. "ortools matplotlib")
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
DEV=${DEVICE_CHECK_DEVICE:-cuda}
WHEELS=${DEVICE_CHECK_WHEELS:-$ROOT/device_wheels}
SCALE=${DEVICE_CHECK_SCALE:-1}
OUTDIR=${DEVICE_CHECK_OUT:-$(mktemp -d /tmp/adaptdist_device_check.XXXXXX)}
VENV=$OUTDIR/venv
BASE=${DEVICE_CHECK_PYTHON:-}
if [ -z "$BASE" ]; then  # the first interpreter on PATH that has torch
  for cand in python3 python3.12 python; do
    if command -v "$cand" >/dev/null && "$cand" -c "import torch" 2>/dev/null; then BASE=$cand; break; fi
  done
fi
BASE=${BASE:-python3}
export VENV BASE WHEELS
START=$(date +%s)
export ADAPTDIST_KERNELS=0 ADAPTDIST_TRACEBACK=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
FAILED=()
if [ -n "${DEVICE_CHECK_BLOCK:-}" ]; then
  mkdir -p "$OUTDIR/block"
  cat > "$OUTDIR/block/sitecustomize.py" <<BLOCK
import sys
class _Blocked:
    names = set("${DEVICE_CHECK_BLOCK}".split())
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ImportError(f"{name} is blocked by DEVICE_CHECK_BLOCK")
sys.meta_path.insert(0, _Blocked())
BLOCK
  export PYTHONPATH=$OUTDIR/block:$PYTHONPATH
fi

limit() { python3 -c "import sys; print(max(1, int(float(sys.argv[1]) * float(sys.argv[2]))))" "$1" "$SCALE"; }

step() {  # step NAME SECONDS COMMAND...: run it under timeout; print its status and time; never stop the script
  local name=$1 secs; secs=$(limit "$2"); shift 2
  echo; echo "=== $name (limit ${secs} s, at $(( $(date +%s) - START )) s)"
  local t0; t0=$(date +%s.%N)
  if declare -F "$1" >/dev/null; then set -- bash -c "$(declare -f "$1"); $1"; fi  # a function: in its own bash
  timeout -k 5 "$secs" "$@"
  local rc=$?
  local dt; dt=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)")
  if [ $rc -eq 0 ]; then echo "=== $name: ok in $dt s"
  else
    [ $rc -eq 124 ] && echo "=== $name: TIMED OUT after $dt s" || echo "=== $name: FAILED (exit $rc) after $dt s"
    FAILED+=("$name")
  fi
}

if [ "$DEV" = cuda ]; then GPT_STEPS=30 SEQ=128 DLRM_STEPS=100 RECSYS_STEPS=150
else GPT_STEPS=3 SEQ=32 DLRM_STEPS=10 RECSYS_STEPS=12; fi  # a dry run tests the plumbing, not the speed

echo "adaptdist device check: device $DEV, out $OUTDIR, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# --- a venv over the machine's torch, with the carried wheels ---------------------------------------------
setup_venv() {
  "$BASE" -m venv --system-site-packages "$VENV" || return 1
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then  # BASE is itself a venv: see its packages too
    local site; site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$BASE" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/_device_check_base.pth"
  fi
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || return 1
  else
    echo "no wheels in $WHEELS: using what the machine has"
  fi
  "$VENV/bin/python" -c "import torch, yaml, safetensors, rich, numpy; print('imports ok: torch', torch.__version__, '| numpy', numpy.__version__)"
}
step "venv (--system-site-packages) + carried wheels" 60 setup_venv
PY=$VENV/bin/python
if ! [ -x "$PY" ] || ! "$PY" -c "import torch, yaml, safetensors, rich, numpy" 2>/dev/null; then
  # no venv (no ensurepip) or no pip: the wheels unpacked into a folder on PYTHONPATH (a wheel is a zip of its files)
  echo "venv unusable: unpacking the wheels into $OUTDIR/site for $BASE"
  PY=$BASE
  "$BASE" -c "
import sys, zipfile, pathlib
for w in sorted(pathlib.Path(sys.argv[1]).glob('*.whl')):
    zipfile.ZipFile(w).extractall(sys.argv[2])" "$WHEELS" "$OUTDIR/site"
  export PYTHONPATH=$PYTHONPATH:$OUTDIR/site
  "$PY" -c "import torch, yaml, safetensors, rich, numpy; print('imports ok: torch', torch.__version__)" || FAILED+=("imports")
fi
export PY

# --- the machine ------------------------------------------------------------------------------------------
machine() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "cores: $(nproc) (os.cpu_count $(python3 -c 'import os; print(os.cpu_count())')); $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null)"
  echo "memory: $(free -g 2>/dev/null | awk '/Mem:/{print $2 " GiB"}'); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$PY" -c "
import sys, torch
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda build', torch.version.cuda,
      '| cuda available', torch.cuda.is_available(), '| devices', torch.cuda.device_count())
if torch.cuda.is_available():
    print('device 0:', torch.cuda.get_device_name(0), '| nccl', torch.cuda.nccl.version())
import torch.distributed as dist
print('gloo', dist.is_gloo_available(), '| nccl', dist.is_nccl_available())"
}
step "machine" 30 machine
step "private torch names (_torch_compat)" 60 "$PY" benchmarks/device_check_compat.py

# --- cluster files: one rank on the device ---------------------------------------------------------------
cat > "$OUTDIR/one.yaml" <<EOF
schema_version: 1
hosts:
  - {name: localhost, device_kind: $DEV, num_devices: 1}
EOF

# --- world size 1 on the device: the built-in GPT, then builtin:dlrm ---------------------------------------
step "train builtin:gpt, 1 rank on $DEV, --plan dp" 75 \
  "$PY" -m adaptdist.cli train --cluster "$OUTDIR/one.yaml" --plan dp --steps $GPT_STEPS --batch-size 8 \
  --seq-len $SEQ --sample-bytes 0 --checkpoint-every 1000000 --out "$OUTDIR/gpt"
step "train builtin:dlrm, 1 rank on $DEV, --mode sync --plan dp" 60 \
  "$PY" -m adaptdist.cli train builtin:dlrm --cluster "$OUTDIR/one.yaml" --mode sync --plan dp --steps $DLRM_STEPS \
  --batch-size 256 --checkpoint-every 1000000 --out "$OUTDIR/dlrm"
step "torch.compile backend, 1 rank on $DEV, vs eager" 60 \
  "$PY" benchmarks/device_check_backend.py --device "$DEV" --steps 3
for d in gpt dlrm; do
  [ -f "$OUTDIR/$d/summary.json" ] && "$PY" -c "
import json, sys; s = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: s.get(k) for k in ('ranks', 'plan', 'mode', 'initial_loss', 'final_loss', 'step_time_s', 'tokens_per_s', 'samples_per_s', 'validation_rmse') if k in s})" "$OUTDIR/$d/summary.json" "$d"
done

# --- bench_recsys: GPU-only, CPU-only, heterogeneous (cpu sparse ranks + the GPU dense rank) ----------------
CPU_RANKS=$(python3 -c "import os; print(max(1, min(4, (os.cpu_count() or 2) // 4)))")
step "bench_recsys --device-figures ($CPU_RANKS cpu ranks + 1 $DEV rank)" 150 \
  "$PY" benchmarks/bench_recsys.py --device-figures --device "$DEV" --cpu-ranks "$CPU_RANKS" --steps $RECSYS_STEPS \
  --batch-size 256 --run-timeout-s "$(limit 45)"

echo
echo "device check finished in $(( $(date +%s) - START )) s; failed steps: ${#FAILED[@]}${FAILED:+ (${FAILED[*]})}; outputs in $OUTDIR"
