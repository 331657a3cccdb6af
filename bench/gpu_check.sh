#!/usr/bin/env bash
# The checks that need a CUDA GPU, run as one script on a GPU machine (see README, "Tested").
# Usage, from the repository root: OUT=<dir> bash bench/gpu_check.sh
set -u
export PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/sprite-gpu}"
mkdir -p "$OUT"
PY=python3
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    echo "editable install failed, see install.log"; tail -5 "$OUT/install.log"; }
ls .whl/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-index --no-deps .whl/*.whl >>"$OUT/install.log" 2>&1
{
    nvidia-smi -L
    $PY -c "import sys, torch, lightning, transformers, peft, pytest; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'pytest', pytest.__version__, 'gpus', torch.cuda.device_count())"
    nproc
} 2>&1 | tee "$OUT/env.txt"
echo "== device tests"
timeout 330 $PY -m pytest -p no:cacheprovider tests/device -v -rA 2>&1 | tee "$OUT/device_tests.log" | tail -40
echo "== shipped suite, collectives, 2 ranks on one GPU"
timeout 120 $PY -m pytest -p no:cacheprovider --pyargs pytest_sprite.suite --ranks=2 -k collectives -v 2>&1 | tee "$OUT/suite.log" | tail -8
echo "== dispatch bench (CPU ranks, quiet 16-core machine)"
timeout 200 $PY bench/dispatch.py 2>&1 | tee "$OUT/dispatch.log" | tail -14
