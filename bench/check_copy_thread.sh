#!/usr/bin/env bash
# One GPU call for the copying thread: the GPU tests, then compiled text fits not drained (where a race in the copy
# shows as a device-side assert), then vision and tabular trained eagerly. Keeps each arm's log.
set -u
out=${1:?usage: check_copy_thread.sh OUT}
python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_pace.py tests/test_gpu.py > $out/gpu_tests.log 2>&1; tail -2 $out/gpu_tests.log
BUDGET=200 TIMEOUT=150 bash bench/first_run.sh $out/text text 1 warm --config '{"text": {"epochs": 4}}' | tail -8
BUDGET=120 TIMEOUT=80 bash bench/first_run.sh $out/vt vision,tabular 1 eager-fused,tiers-cold | tail -12
bash bench/host_time.sh $out/host 1 | tail -3
