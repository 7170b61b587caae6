#!/usr/bin/env bash
# The checks that need a CUDA device, in one run of a few minutes on one GPU: the CUDA tests
# (the same numbers as on the CPU, no host synchronization before a logged step or between two
# reference batches, the output-head path in bfloat16, FSDP / FSDP2 with configure_model scoring
# the policy itself) and the GPU figures of the benchmarks (reference scoring vs a bare forward,
# a >= 100M-parameter model in bfloat16; one 128k-vocabulary batch, general vs output-head path).
# Logs go to OUT_DIR (default ./gpu_checks_out).
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]
set -uo pipefail
out=${1:-gpu_checks_out}
mkdir -p "$out"
export PYTHONPATH=$PWD WANDB_MODE=offline PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.log"
python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py 2>&1 | tail -15 | tee "$out/test_cuda.log"
python3 benchmarks/bench_reference.py --device cuda --model medium --dtype bfloat16 --skip-remote --budgets 8192 16384 2>&1 | tee "$out/bench_reference_medium_bf16.log"
python3 benchmarks/bench_reference.py --device cuda --dtype bfloat16 --head-memory 2>&1 | tee "$out/bench_reference_head_memory.log"
python3 benchmarks/bench_reference.py --device cuda --budgets 4096 16384 2>&1 | tee "$out/bench_reference.log"
python3 benchmarks/bench_rl_metrics.py --device cuda 2>&1 | tee "$out/bench_rl_metrics.log"
python3 benchmarks/bench_callback.py --accelerator gpu --steps 200 --repeats 2 2>&1 | tail -6 | tee "$out/bench_callback.log"
