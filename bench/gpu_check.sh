#!/usr/bin/env bash
# The GPU checks, in one run on a machine with a CUDA device: the learner's
# device-placement tests, then bench/learner_device.py (samples trained per second on cpu and cuda).
#
#   bash bench/gpu_check.sh            # python3 with torch; wheels from .whl/ installed into $SITE first
#   WHEELS= PYTHON=.venv/bin/python bash bench/gpu_check.sh   # here: the venv has every package already
#
# Wheels: the packages kuberl's actor, learner, buffer and `kuberl up` need beyond an image that holds
# torch and numpy (pygame too, which PettingZoo's tic-tac-toe imports), as cp312 manylinux / py3-none-any wheels in .whl/ (installed with --no-deps into
# $SITE, put first on PYTHONPATH). Every step runs under `timeout`, and the steps together within
# $BUDGET seconds (default 400). Writes to $OUT (default /tmp/gpu_check): env.txt, pytest.log,
# learner_device.log and learner_device.json, then a `kuberl up` of two policies whose learners share the
# GPU (policies.log, policies_summary.json, gpu_apps.txt). UNITS=0 skips the broad unit suites,
# BENCH=0 the learner benchmark, POLICIES_STEPS=0 the two-policy run. Exits non-zero if a step failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS-.whl}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/gpu_check}
BUDGET=${BUDGET:-400}
BENCH_ARGS=${BENCH_ARGS:---seconds 10 --cpu-threads 16}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
FAILED=$(mktemp)  # a step's failure is written here: steps run inside `| tee` pipelines (subshells)

left() {  # seconds of the budget left, capped at $1, at least 10
    local l=$((BUDGET - (SECONDS - START)))
    ((l > $1)) && l=$1
    ((l < 10)) && l=10
    echo "$l"
}

step() {  # step NAME CAP COMMAND...: run COMMAND under timeout (CAP seconds, or what the budget has left)
    local name=$1 cap; cap=$(left "$2"); shift 2
    echo "=== $name (timeout ${cap}s, ${SECONDS}s in)"
    timeout -k 10 "$cap" "$@"
    local rc=$?
    ((rc == 0)) || { echo "=== $name: exit $rc"; echo -n "$name($rc); " >>"$FAILED"; }
    return 0
}

if [[ -n "$WHEELS" ]]; then
    step "install wheels" 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
    [[ -s "$FAILED" ]] && { echo "the wheels did not install"; exit 1; }
    export PYTHONPATH=$SITE:$PWD:$PWD/protos
else
    export PYTHONPATH=$PWD:$PWD/protos
fi

{
    echo "python: $("$PY" --version 2>&1) at $(command -v "$PY"); PYTHONPATH=$PYTHONPATH"
    timeout 30 nvidia-smi || echo "nvidia-smi: none or failed"
    timeout "$(left 120)" "$PY" - <<'EOF'
import importlib

import torch

print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
          f"cudnn {torch.backends.cudnn.version()}, {torch.cuda.mem_get_info()[1] / 2**30:.0f} GiB")
    x = torch.randn(1024, 1024, device="cuda")
    print(f"a matmul on cuda: {(x @ x).sum().item():.1f}")
for name in ("numpy", "grpc", "grpc_health", "grpc_reflection", "google.protobuf", "gymnasium", "ale_py",
             "tensorboardX", "cv2", "yaml", "uvloop", "prometheus_client", "pytest", "pytest_asyncio", "pytest_timeout"):
    try:
        m = importlib.import_module(name)
        print(f"{name:18s} {getattr(m, '__version__', '?'):12s} {m.__file__}")
    except Exception as err:  # noqa: BLE001 (a report, not a check: the tests below fail on what matters)
        print(f"{name:18s} MISSING: {err!r}")
from kuberl.v1 import common_pb2  # protobuf 7 gencode: refuses an older runtime at import
print("kuberl.v1 stubs import:", common_pb2.DESCRIPTOR.name)
EOF
} 2>&1 | tee "$OUT/env.txt"
((${PIPESTATUS[0]} == 0)) || echo -n "env; " >>"$FAILED"

# Plugins named, not auto-loaded: the image's own pytest plugins (cov, xdist, benchmark...) stay out.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
PYTEST=("$PY" -m pytest -p no:cacheprovider -p pytest_asyncio.plugin -p pytest_timeout -rs)
{
    # (a) device placement: the cuda tests must pass here, not skip.
    step "pytest: device tests" 150 "${PYTEST[@]}" -v tests/unit/learner/test_device.py
    # The learner, actor and buffer units on this image's torch and Python (cpu: learner.device defaults to cpu).
    if [[ ${UNITS:-1} != 0 ]]; then
        step "pytest: learner, actor, buffer units" 150 "${PYTEST[@]}" -q tests/unit/learner tests/unit/actor \
            tests/unit/buffer tests/unit/common/test_config.py tests/unit/test_algorithm_seam.py
    fi
} 2>&1 | tee "$OUT/pytest.log"

# (b) the learner on cpu and cuda; the JSON is written after each algorithm, so a cut-off run keeps the rest.
# shellcheck disable=SC2086
if [[ ${BENCH:-1} != 0 ]]; then
    step "bench.learner_device" 300 "$PY" -m bench.learner_device --out "$OUT/learner_device.json" $BENCH_ARGS \
        2>&1 | tee "$OUT/learner_device.log"
fi

# (c) two policies' learners on one GPU through the whole stack: tic-tac-toe, player_1 and player_2 each
# a policy with its own learner process (two CUDA contexts on the one device), `kuberl up` without the planner.
if [[ ${POLICIES_STEPS:-200000} != 0 ]]; then
    RUNS=$(mktemp -d)
    cat >"$RUNS/two_policies.yaml" <<EOF2
algorithm: ppo
seed: 0
env: {id: "pettingzoo:pettingzoo.classic.tictactoe_v3", num_envs: 16}
policies: {x: {agents: [player_1]}, o: {agents: [player_2]}}
planner: {enabled: false}
learner: {device: cuda}
ppo: {rollout_steps: 32, batch_steps: 1024}
run: {return_window: 200, max_env_steps: ${POLICIES_STEPS:-200000}}
EOF2
    (for _ in $(seq 60); do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; sleep 3; done) \
        >"$OUT/gpu_apps.txt" 2>&1 &
    SMI=$!
    step "kuberl up: two policies' learners on one GPU" 240 "$PY" -m services.cli.main up "$RUNS/two_policies.yaml" \
        --run-dir "$RUNS" --name policies 2>&1 | tail -n 12 | tee "$OUT/policies.log"
    kill "$SMI" 2>/dev/null
    cp "$RUNS/policies/summary.json" "$OUT/policies_summary.json" 2>/dev/null
    grep -h "training on\|restored\|Error\|error" "$RUNS"/policies/logs/learner-*.log | head -n 20 | tee -a "$OUT/policies.log"
fi

echo "=== done in $((SECONDS - START)) s; failed: $(cat "$FAILED")"
[[ ! -s "$FAILED" ]]
