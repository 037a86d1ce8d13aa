#!/usr/bin/env bash
# One GPU window of the confirmatory 124M study (configs/studies/confirm-124m-gpu.yaml; issue 42), the first command
# a window runs, with a fixed deadline: SECONDS from its start, less a margin.
#
#   bash benchmarks/gpu_window.sh SECONDS OUTDIR [--mfu-s N] [-- confirm_window.py run options]
#
# 1. OUTDIR/nvidia-smi.txt: the GPU, driver, clocks, torch and CUDA versions;
# 2. the step measurements of issue 42 item 3 (first --mfu-s seconds, default 120; 0 skips it): benchmarks/
#    loss_path.py at 124M, 12 x 1024, bf16, CLM and ESLM-entropy at alpha 0.2 and 0.5, eager, every variant timed
#    round-robin against the eager CLM baseline in the same process, then the same compiled if time is left;
#    the result files in OUTDIR/mfu.tar.gz, the log in OUTDIR/mfu.log;
# 3. benchmarks/confirm_window.py run: checks the carried corpus (data/confirm-gpt2) against the study file's
#    content hash, skips every run recorded under benchmarks/results/confirm-124m-gpu/, runs the next runs in
#    priority order until the deadline, and after each finished run rewrites OUTDIR/records.tar.gz (every finished
#    run's records and window.json), so a window cut at any moment returns every finished run. Log: OUTDIR/window.log.
#
# After the window: python benchmarks/confirm_window.py import <files_at>/records.tar.gz, commit the records.
# The device call (about 15 minutes of device time, start included; at most 10 minutes per command):
#   run(command="bash benchmarks/gpu_window.sh 570 $OUT", carry=["data/confirm-gpt2"], timeout_s=600)
# Its CPU smoke (tests/test_gpu_window.py): a tiny study, fp32, --mfu-s 0, with --study/--set/--corpus-hash.
set -u -o pipefail
total=${1:?usage: gpu_window.sh SECONDS OUTDIR [--mfu-s N] [-- run options]}
out=$(mkdir -p "${2:?usage: gpu_window.sh SECONDS OUTDIR [--mfu-s N] [-- run options]}" && cd "$2" && pwd) || exit 2
shift 2
mfu_s=120
if [ "${1:-}" = "--mfu-s" ]; then mfu_s=${2:?--mfu-s needs seconds}; shift 2; fi
[ "${1:-}" = "--" ] && shift
start=$(date +%s)
deadline=$((start + total))
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv 2>&1 \
    || echo "no nvidia-smi"
  python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda)" 2>&1; } >"$out/nvidia-smi.txt"
if [ "$mfu_s" -gt 0 ]; then
    mfu=$(mktemp -d)
    lp="python benchmarks/loss_path.py --preset gpt2-124m --seq-len 1024 --micro-batch 12 --device cuda --dtype bf16 \
--steps 10 --warmup 3 --alphas 0.2 0.5 --routes"
    {
        ESLM_BENCH_RESULTS="$mfu" timeout $((mfu_s * 5 / 8)) $lp --name window-eager
        left=$((start + mfu_s - $(date +%s)))
        [ "$left" -gt 30 ] && ESLM_BENCH_RESULTS="$mfu" timeout "$left" $lp --compile --warmup 4 --name window-compile
    } >"$out/mfu.log" 2>&1
    tar -czf "$out/mfu.tar.gz" -C "$mfu" . 2>>"$out/mfu.log"
fi
python benchmarks/confirm_window.py run --out "$out" --deadline "$deadline" "$@" 2>&1 | tee "$out/window.log"
echo "gpu_window: $(($(date +%s) - start)) s of $total" | tee -a "$out/window.log"
