#!/bin/bash
# Issues 36 and 38's checks on a lent GPU, as one call of the device tool (bench/README.md):
#   carry .whl (pydantic, pulp, highspy, torchao wheels for the device's Python; pip download
#   --python-version 3.12 --platform manylinux_2_28_x86_64 ..., as in the device tool's notes)
#   command: [PARTS=a,b] bash bench/gpu_checks.sh [all|ledger|shapes]
# Writes under $OUT: log.txt, ledger_result.json (+ rank0/1.json), shapes.json. Read here by
# bench/gpu_checks_report.py.
set -u
what=${1:-all}
exec > >(tee "$OUT/log.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,power.limit,driver_version --format=csv
python3 -c "import torch, torchao, pydantic, pulp; print('torch', torch.__version__, 'torchao', torchao.__version__)"
date -u
if [ "$what" != shapes ]; then
# issue 36: a plan with two dp ranks and 4 micro-batches (ZeRO-0, DDP) on the one GPU: the
# ranks share it over gloo (executor/worker.py), the ledger shows the syncs per step
timeout 200 python3 -c "import sys; from api.cli import main; sys.exit(main())" execute \
  bench/results/gpu_ledger_plan.json --steps 4 --timeout 150 --out /tmp/ledger_run
echo "execute rc=$?"
cp /tmp/ledger_run/result.json "$OUT/ledger_result.json"
for f in /tmp/ledger_run/rank*.json; do cp "$f" "$OUT/ledger_$(basename "$f")"; done
date -u
fi
[ "$what" = ledger ] && exit 0
# issue 38: the GEMMs of tensor-parallel ranks' layers at their own shapes, attention to 128K,
# one Llama-3-70B tp4 block in bf16 and float8
timeout 300 python3 bench/gpu_measure.py --out "$OUT/shapes.json" \
  --parts "${PARTS:-layer_gemms,long_attention,fp8_layer}"
date -u
