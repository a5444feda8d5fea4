#!/usr/bin/env bash
# Run THERE (the GPU machine, through the device tool's `run`, carry ["bench/gpu/.wheels"]):
# installs the wheels that bench/gpu/prepare.sh made here (no network there), then runs the
# benchmark; its files go to $OUT (the tool's output folder), else bench/results/gpu.
#
#     bash bench/gpu/run.sh [main_job.py flags, e.g. --budget-s 420 --only main,peer-amp]
#     NXD_BENCH_PROFILE=1 bash bench/gpu/run.sh ...   # then profile_step.py (where a step goes)
#     NXD_BENCH_MOE=0 bash bench/gpu/run.sh ...       # skip moe_experts.py (grouped vs bmm, ~30 s)
set -uo pipefail
cd "$(dirname "$0")/../.."
wheels=bench/gpu/.wheels
if ! ls "$wheels"/nxd_trainer-*.whl >/dev/null 2>&1; then
    echo "run.sh: no nxd wheels in $wheels: run bench/gpu/prepare.sh first and carry $wheels" >&2
    exit 2
fi
site=${NXD_BENCH_SITE:-/tmp/nxd-bench-site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# Every third-party module nxd-train imports at run time, before any device time is spent on it.
python3 -c "import nxd_trainer.train.cli, tensorboardX, isal, tqdm, tokenizers, tomli_w, filelock" || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
python3 bench/gpu/main_job.py --out "$out" "$@" 2>&1 | tee "$out/console.log"
rc=${PIPESTATUS[0]}
if [ "${NXD_BENCH_MOE:-1}" = 1 ]; then
    python3 bench/gpu/moe_experts.py --out "$out" 2>&1 | tee "$out/moe_experts.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "${NXD_BENCH_PROFILE:-0}" = 1 ]; then
    python3 bench/gpu/profile_step.py --out "$out" 2>&1 | tee "$out/profile.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit "$rc"
