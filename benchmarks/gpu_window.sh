#!/usr/bin/env bash
# One GPU window of a fixed length, as the device tool lends it (15 minutes of device time, the machine's start
# included): benchmarks/gpu_suite.py without its compile step first (measurements, `pytest -m gpu`, the two
# 124M training runs), then the compiled loss path in whatever time is left.
#
#   bash benchmarks/gpu_window.sh SECONDS OUTDIR [suite options...]
#
# Everything lands in OUTDIR as it finishes (nvidia-smi.txt, suite.log + suite.tar.gz, compile.log +
# compile.tar.gz), so a window cut short still returns what ended. The corpus data/stdlib-gpt2 must travel with
# the working tree (gpu_suite.py's docstring says how to prepare it). The CPU smoke of this script:
#   bash benchmarks/gpu_window.sh 600 /tmp/w --device cpu --preset tiny --data DIR --compile yes
set -u -o pipefail
total=${1:?usage: gpu_window.sh SECONDS OUTDIR [suite options]}
out=${2:?usage: gpu_window.sh SECONDS OUTDIR [suite options]}
shift 2
start=$(date +%s)
left() { echo $((total - ($(date +%s) - start))); }
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
run=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv \
    >"$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" >"$out/nvidia-smi.txt"
python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda)" >>"$out/nvidia-smi.txt" 2>&1
# the compile step's share: 180 s, or a quarter of a short window
reserve=$((total / 4 < 180 ? total / 4 : 180))
python benchmarks/gpu_suite.py --out "$run/suite" --bundle "$out/suite.tar.gz" --skip loss_path_compile \
    --budget-s $(($(left) - reserve - 15)) "$@" 2>&1 | tee "$out/suite.log"
if [ "$(left)" -gt 60 ]; then
    # the compiled loss path chooses routes with the coefficients the first part measured
    [ -f "$run/suite/head_costs.json" ] && export ESLM_HEAD_COSTS="$run/suite/head_costs.json"
    python benchmarks/gpu_suite.py --out "$run/compile" --bundle "$out/compile.tar.gz" \
        --skip env calibrate loss_path profile pytest train_clm train_eslm_entropy \
        --budget-s $(($(left) - 10)) "$@" 2>&1 | tee "$out/compile.log"
fi
echo "gpu_window: $(($(date +%s) - start)) s of $total"
