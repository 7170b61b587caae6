#!/usr/bin/env bash
# The checks that need a CUDA device, in one run of a few minutes on one GPU: the CUDA tests
# (the same numbers as on the CPU, no host synchronization before a logged step or between two
# reference batches, the output-head path in bfloat16, FSDP / FSDP2 with configure_model scoring
# the policy itself, a vLLM server synced over NCCL by VLLMServerFleet) and the GPU figures of the
# benchmarks (reference scoring vs a bare forward, a >= 100M-parameter model in bfloat16; one
# 128k-vocabulary batch, general vs output-head path; where the GPU time goes: gpu_profile.py).
# Logs go to OUT_DIR (default ./gpu_checks_out). Run from the repository root.
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]
#
# Every step runs with $PYTHON (default: python3 from PATH), e.g. PYTHON=.venv/bin/python.
#
# Exit status: 0 every check ran, 1 a check failed (its log says which), 3 no CUDA device here
# (one line, and nothing is written).
set -uo pipefail
out=${1:-gpu_checks_out}
python=${PYTHON:-python3}
"$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null  # one import of torch
case $? in
  0) ;;
  3) echo "gpu_checks.sh: no CUDA device here (torch.cuda.is_available() is False); nothing was run or written" >&2
     exit 3 ;;
  *) echo "gpu_checks.sh: $(command -v "$python") cannot import torch; install the checkout first: pip install -e \".[dev]\"" >&2
     exit 1 ;;
esac
mkdir -p "$out"
failed=0
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} WANDB_MODE=offline PYTHONUNBUFFERED=1
"$python" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.log" || failed=1
"$python" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py -k "not nccl" 2>&1 | tee "$out/test_cuda.log" | tail -25 || failed=1
"$python" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py -k nccl 2>&1 | tee "$out/test_cuda_fleet_nccl.log" | tail -15 || failed=1  # a vLLM server synced over NCCL (needs vLLM's CUDA build)
"$python" benchmarks/bench_reference.py --device cuda --model medium --dtype bfloat16 --skip-remote --budgets 8192 16384 2>&1 | tee "$out/bench_reference_medium_bf16.log" || failed=1
"$python" benchmarks/bench_reference.py --device cuda --dtype bfloat16 --head-memory 2>&1 | tee "$out/bench_reference_head_memory.log" || failed=1
"$python" benchmarks/bench_reference.py --device cuda --budgets 4096 16384 2>&1 | tee "$out/bench_reference.log" || failed=1
"$python" benchmarks/bench_rl_metrics.py --device cuda 2>&1 | tee "$out/bench_rl_metrics.log" || failed=1
"$python" benchmarks/bench_callback.py --accelerator gpu --steps 200 --repeats 2 2>&1 | tee "$out/bench_callback.log" | tail -8 || failed=1
"$python" benchmarks/gpu_profile.py 2>&1 | tee "$out/gpu_profile.log" | grep -v "^INFO" || failed=1
exit $failed
