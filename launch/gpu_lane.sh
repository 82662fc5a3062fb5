#!/usr/bin/env bash
# One GPU lane in one command: environment facts, the multi-GPU tests (session, layer, gradients,
# integrations), the link ceilings, the front-end benchmark at W ranks and at every smaller W in
# {2, 4, 8}, and the layer benchmark (forward, forward + backward) at W.
#
#   launch/gpu_lane.sh W [--dry-run] [--only STEPS] [--rows SPEC] [--out DIR] [-- BENCH_ARGS...]
#
#   W           ranks, one per GPU: 2, 4 or 8
#   --dry-run   the whole lane on ONE GPU with W ranks sharing it (gloo group, NVLink path allowed
#               on a shared GPU, tiny rows): checks the lane before multi-GPU machines are lent;
#               its numbers are harness checks, not multi-GPU numbers
#   --only      comma-separated subset of facts,tests,link,bench,layer (default: all, in order)
#   --rows      benchmark rows (default: full; tiny with --dry-run)
#   --out       where JSON/PNG/Markdown/logs go (default: docs/results; out/lane_dry_run with
#               --dry-run)
#   BENCH_ARGS  passed to the main benchmark as they are
#
# Environment: PYTHON (default python3); PYTHONPATH is kept and extended.  Without network, a
# missing nvshmem4py is installed from .whl/ into CAKE_SP_SITE (default /tmp/site).
set -uo pipefail

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

[[ $# -ge 1 ]] || usage
W=$1; shift
[[ $W == 2 || $W == 4 || $W == 8 ]] || { echo "W must be 2, 4 or 8, got '$W'" >&2; usage; }
DRY_RUN=0; ONLY="facts,tests,link,bench,layer"; ROWS=""; OUT=""; BENCH_ARGS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --only) ONLY=$2; shift ;;
    --rows) ROWS=$2; shift ;;
    --out) OUT=$2; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "unknown argument '$1'" >&2; usage ;;
  esac
  shift
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-python3}
SITE=${CAKE_SP_SITE:-/tmp/site}
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# No multicast objects, ever (NVLS): NCCL, torch symmetric memory and NVSHMEM alike.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [[ $DRY_RUN == 1 ]]; then
  ROWS=${ROWS:-tiny}; OUT=${OUT:-out/lane_dry_run}
  # Every rank on GPU 0; the session's mesh probe accepts a shared GPU only with this switch.
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} CAKE_SP_ALLOW_SHARED_GPU=1
  TEST_DEVICE=cuda-shared; TEST_BACKENDS="nvlink"
else
  ROWS=${ROWS:-full}; OUT=${OUT:-docs/results}
  TEST_DEVICE=cuda; TEST_BACKENDS="nvlink nccl"  # the product path first
fi
mkdir -p "$OUT"
FAILED=()

step() {  # step NAME LOG CMD...: run, tee to the log, remember a failure and go on
  local name=$1 log=$2; shift 2
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  [[ $rc == 0 ]] || { echo "=== $name FAILED (exit $rc)"; FAILED+=("$name"); }
}

wants() { [[ ",$ONLY," == *",$1,"* ]]; }

if ! "$PYTHON" -c "import nvshmem.core" 2>/dev/null && compgen -G ".whl/nvshmem4py*.whl" >/dev/null; then
  echo "=== installing nvshmem4py from .whl/ into $SITE"
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" .whl/nvshmem4py*.whl \
    || FAILED+=("nvshmem4py install")
fi

GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ $DRY_RUN == 0 && $GPUS -lt $W ]]; then
  echo "this machine has $GPUS GPUs, the lane needs $W (use --dry-run to share one GPU)" >&2
  exit 2
fi

facts() {
  nvidia-smi -L
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  "$PYTHON" - <<'EOF'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
for name in ("nvshmem4py-cu13", "nvshmem4py-cu12", "cuda-python", "nvidia-ml-py", "triton"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF
  git log -1 --format='commit %H %s'
}

LOG="$OUT/lane_${W}"
[[ $DRY_RUN == 1 ]] && echo "=== DRY RUN: $W ranks share GPU ${CUDA_VISIBLE_DEVICES}; not multi-GPU numbers"
wants facts && step facts "${LOG}_facts.log" facts

if wants tests; then
  for backend in $TEST_BACKENDS; do
    # The NVLink run asks for "auto" (the mesh must choose nvlink); the NCCL run forces nccl.
    request=$([[ $backend == nvlink ]] && echo auto || echo nccl)
    step "tests ($backend)" "${LOG}_tests_${backend}.log" env CAKE_SP_TEST_DEVICE=$TEST_DEVICE \
      CAKE_SP_TEST_WORLDS=$W CAKE_SP_TEST_BACKEND=$backend CAKE_SP_TEST_REQUEST=$request \
      "$PYTHON" -m pytest tests/multi_gpu -m multi_gpu -v -rfE
  done
fi

TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone)
wants link && step link "${LOG}_link.log" "${TORCHRUN[@]}" --nproc-per-node="$W" \
  benchmarks/comm/bench_link.py --json "${LOG}_link.json"

if wants bench; then
  # Largest first, so W itself comes first and a run cut by a time limit keeps the lane's table.
  for w in 8 4 2; do
    [[ $w -le $W ]] || continue
    name=$LOG; [[ $w == "$W" ]] || name="${LOG}_w${w}"
    step "bench W=$w" "${name}.log" "${TORCHRUN[@]}" --nproc-per-node="$w" \
      benchmarks/comm/bench_qkv_norm_rope_exchange_overlap.py --rows "$ROWS" \
      --json "${name}.json" --markdown "${name}.md" --plot "${name}.png" "${BENCH_ARGS[@]}"
  done
fi

if wants layer; then
  # With ranks sharing one GPU only cake_sp runs (a smoke test of the NVLink path).
  layer_rows=$([[ $DRY_RUN == 1 ]] && echo smoke || echo all)
  step "layer bench W=$W" "${LOG}_layer.log" "${TORCHRUN[@]}" --nproc-per-node="$W" \
    benchmarks/layer/bench_ulysses_attention.py --mode fwd,fwdbwd --rows "$layer_rows" \
    --json "${LOG}_layer.json"
fi

if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "=== lane W=$W: FAILED steps: ${FAILED[*]}"
  exit 1
fi
echo "=== lane W=$W: all steps passed; results in $OUT"
