#!/usr/bin/env bash
# GPU checks in one call: GPU-marked tests (bf16/fp16 kernels and the PEFT oracle on CUDA),
# then the kernel benchmark. Results land in $OUT (or ./out). Wheels missing on the GPU
# machine can be placed in .whl/ beforehand.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
export PYTHONUNBUFFERED=1
tests=("$@"); [ ${#tests[@]} -eq 0 ] && tests=(tests/lora/test_ops.py tests/model/test_oracle_peft.py)
python3 -m pytest -q -m gpu -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 benchmarks/lora_kernels.py --append "$OUT/kernels.md" 2>&1 | tee "$OUT/kernels.log" | tail -60
