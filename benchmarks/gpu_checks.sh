#!/usr/bin/env bash
# GPU checks in one call: GPU-marked tests (kernels, PEFT oracle in bf16/fp16, CUDA graphs),
# then benchmarks. Results land in $OUT (or ./out). Wheels missing on the GPU machine can be
# placed in .whl/ beforehand. Usage: gpu_checks.sh [tests|kernels|epilogues|dora_epilogues|decode|mixed_rank|rank_epilogues|rank64|base32|b_layout|ncu|fp8|fp8_gemms|storm ARGS...|zipf|load_rate|sustained|moe|moe_configs|spec]
# A copy of the tree without its .git (git archive) stamps results with $LORAPLEX_COMMIT:
# export it (benchmarks/record.py). Several commits side by side in one call (A/B, bisect):
# benchmarks/ab_snapshots.sh.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
export PYTHONUNBUFFERED=1
what=${1:-all}; shift || true
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/model tests/adapters/test_combine.py tests/adapters/test_added_tokens.py \
    tests/engine/test_pipelined.py tests/adapters/test_loader_process.py tests/adapters/test_loader_staging.py tests/engine/test_full_module_adapters.py tests/engine/test_chain_admission.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|^E " | tail -25
  # every kernel-vs-twin test (not only the gpu-marked ones): bfloat16 runs only here
  python3 -m pytest -q -p no:cacheprovider tests/model/test_fused_kernels.py \
    tests/model/test_rank_bound_kernels.py tests/model/test_fp8_w8a8.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" \
    | grep -E "passed|failed|Error|^E " | tail -10
fi
if [[ $what == all || $what == kernels ]]; then
  python3 benchmarks/lora_kernels.py --append "$OUT/kernels.md" > "$OUT/kernels.log" 2>&1; tail -5 "$OUT/kernels.log"
  python3 benchmarks/attention.py --append "$OUT/attention.md" 2>&1 | tee "$OUT/attention.log" | tail -20
fi
if [[ $what == all || $what == epilogues ]]; then
  python3 -m benchmarks.epilogue_configs --out "$OUT/epilogues.md" 2>&1 | tee "$OUT/epilogues.log" | tail -12
fi
if [[ $what == all || $what == decode ]]; then
  python3 -m benchmarks.decode --append "$OUT/decode.md" "$@" 2>&1 | grep -v "\[info" | tee "$OUT/decode.log" | tail -45
fi
if [[ $what == all || $what == mixed_rank ]]; then
  python3 -m benchmarks.mixed_rank --append "$OUT/mixed_rank.md" 2>&1 | grep -v "\[info" | tee "$OUT/mixed_rank.log" | tail -12
fi
if [[ $what == all || $what == dora_epilogues ]]; then  # issue 19: the DoRA variant's price per kernel
  python3 -m benchmarks.dora_epilogues --append "$OUT/dora_epilogues.md" 2>&1 | tee "$OUT/dora_epilogues.log" | tail -14
fi
if [[ $what == all || $what == rank_epilogues ]]; then  # issue 19: the epilogues at rank 64
  python3 -m benchmarks.norm_configs --ranks 16 64 --batches 32 64 2>&1 | tee "$OUT/rank_norms.log" | tail -10
  python3 -m benchmarks.epilogue_configs --rank 64 --batches 32 64 --loras 8 --out "$OUT/rank_epilogues.md" 2>&1 \
    | tee "$OUT/rank_epilogues.log" | tail -6
fi
if [[ $what == rank64 ]]; then  # issue 19 item 5: the rank-64 step's launches with a cold L2 (~7 min)
  python3 -m benchmarks.layer_breakdown --batches 32 --loras 8 --rank 64 --cold-l2 2>&1 | tee "$OUT/rank64_layer.log" | tail -3
  python3 -m benchmarks.norm_configs --ranks 64 --batches 32 64 --cold-l2 2>&1 | tee "$OUT/rank64_norms.log" | tail -4
  python3 -m benchmarks.epilogue_configs --rank 64 --batches 32 64 --loras 8 --cold-l2 \
    --out "$OUT/rank64_epilogues.md" 2>&1 | tee "$OUT/rank64_epilogues.log" | tail -6
  for p in 1 2 4; do for bn in 32 64; do  # attention at 32 streams: 27 µs against a 17 µs floor
    echo "block_n $bn: $(python3 benchmarks/attention.py --batches 32 --ctx 512 --partitions $p --block-n $bn 2>&1 | tail -1)"
  done; done | tee "$OUT/rank64_attention.log"
fi
if [[ $what == base32 ]]; then  # issue 19 item 5: the base step's own gaps at 32 streams (~6 min)
  # the projection GEMMs with rank-64 A rows, cuBLAS / cuBLASLt / our split-K GEMM, cold L2
  python3 -m benchmarks.base_configs --batches 32 64 --rank 64 --cold-l2 --triton --only gemms \
    --out "$OUT/base32.md" 2>&1 | grep -v "^  " | tee "$OUT/base32_gemms.log" | tail -20
  # attention at 32 streams over contexts: is one partition (faster at ctx 512) safe longer?
  for ctx in 512 2048 4000; do
    python3 -m benchmarks.base_configs --batches 32 --ctx $ctx --cold-l2 --only attention \
      --out "$OUT/base32.md" 2>&1 | tee "$OUT/base32_attention_$ctx.log" | grep -E "\| (auto|1|2|4) \| 64 "
  done
fi
if [[ $what == b_layout ]]; then  # issue 19 item 5: does a column-major B speed the rank-64 expand? (~6 min)
  for lay in rank-major column-major; do
    python3 -m benchmarks.norm_configs --ranks 64 --batches 32 --cold-l2 --b-layout $lay 2>&1 \
      | grep "loras 8" | sed "s/^/$lay: /" | tee -a "$OUT/b_layout.log"
    python3 -m benchmarks.epilogue_configs --rank 64 --batches 32 64 --loras 8 --cold-l2 \
      --b-layout $lay 2>&1 | grep "^| \(silu\|qkv\)" | sort -u | sed "s/^/$lay: /" | tee -a "$OUT/b_layout.log"
  done
fi
if [[ $what == ncu ]]; then  # issue 19 item 5: why the rank-64 expand reads B at ~2.3 TB/s (~5 min)
  # every launch of one decode layer (32 streams, 8 rank-64 slots, then no LoRA), once each,
  # under Nsight Compute (caches flushed before each kernel: cold, as in the step)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
  for loras in 8 0; do
    timeout 280 "$NCU" --clock-control none --nvtx --nvtx-include "layer/" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      python3 -m benchmarks.layer_breakdown --batches 32 --loras $loras --rank 64 --launch-only 1 \
      > "$OUT/ncu_loras$loras.txt" 2>&1
    echo "loras $loras: rc $?"; grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Achieved Occupancy" \
      "$OUT/ncu_loras$loras.txt" | head -60
  done
fi
if [[ $what == fp8 ]]; then  # issue 15 in one call (~8 min): the fp8 GPU tests, then the step
  python3 -m pytest -q -p no:cacheprovider tests/model/test_fp8_w8a8.py tests/model/test_fp8_w8a8_engine.py \
    tests/model/test_fp8_forward.py tests/model/test_fp8_linear.py tests/model/test_fp8_gemv.py 2>&1 | tee "$OUT/fp8_tests.log" \
    | grep -E "passed|failed|Error|^E " | tail -10
  python3 -m benchmarks.decode --no-hf --adapters 8 --batches 1 16 64 \
    --quantization none fp8 fp8-w8a16 fp8-w8a8 --append "$OUT/decode.md" "$@" 2>&1 | grep -v "\[info" \
    | tee "$OUT/decode.log" | tail -30
fi
if [[ $what == fp8_gemms ]]; then  # issue 15: cuBLASLt fp8 forms, W8A16 vs W8A8 projections (~2 min)
  python3 -m benchmarks.fp8_scaled_mm --out "$OUT/scaled_mm.json" "$@" 2>&1 | grep -v "^  skip" \
    | tee "$OUT/scaled_mm.log" | grep -E "_aug|_part|TB/s" | tail -60
fi
if [[ $what == storm ]]; then
  python3 -m benchmarks.storm --out "$OUT/storm.json" --plot "$OUT/storm.png" "$@" 2>&1 | grep -v -E "^\[|\[(info|warn)" \
    | tee "$OUT/storm.log" | tail -30
fi
if [[ $what == zipf ]]; then  # issue 11: the four Zipf points, cold against warm (~6 min)
  # (~75 s a run with the engine's start: the LRU / GDF A/B with yardsticks is 8 points x 2
  # runs, so give it in calls of two points, e.g. --sweep max_loras=8 alpha=0.8
  # adapter_eviction=lru,gdf)
  python3 -m loraplex.engine.bench.coldload --synthetic llama3-8b --num-adapters 1000 --rank 16 \
    --targets q_proj,k_proj,v_proj,o_proj --distinct 16 --source local --rate 12 --duration 30 \
    --prompt-len 128-512 --output-len 32-128 --base-fraction 0.1 --max-cpu-loras 128 \
    --kv-cache-gb 16 --drain-timeout 10 --warm-yardstick --no-plots \
    --sweep max_loras=8,32 alpha=0.8,1.1 --out "$OUT/study" "$@" 2>&1 \
    | grep -v -E "\[(info|warn)|req/s\]" | tee "$OUT/zipf.log" | tail -30
fi
if [[ $what == load_rate ]]; then  # issue 41: the cold-load rate one engine sustains (~4 min)
  # light requests (2-4 tokens out) so that loads, not the GPU, set the limit; 27 MB rank-16
  # q/k/v/o adapters; 400 requests/s offer ~210 cold loads/s. At 48f6904 with 8-16 tokens out
  # (300 requests/s) the 8B step was the limit: requests queued ~2 s, loads waited for host
  # memory held by adapters whose requests were queued (the "waiting for host memory" figure),
  # 29 loads/s. The "CPU (cores)" line tells the loop's, step's and helpers' shares
  python3 -m loraplex.engine.bench.coldload --synthetic llama3-8b --num-adapters 1000 --rank 16 \
    --targets q_proj,k_proj,v_proj,o_proj --distinct 16 --source local --duration 15 --rate 400 \
    --prompt-len 16-64 --output-len 2-4 --base-fraction 0.1 --max-cpu-loras 128 --kv-cache-gb 16 \
    --drain-timeout 10 --max-loras 32 --alpha 0.8 --no-plots --max-concurrent-loads 16 \
    --sweep loader_processes=4,8 --out "$OUT/load_rate" "$@" 2>&1 \
    | grep --line-buffered -v -E "\[(info|warn)|req/s\]" | tee "$OUT/load_rate.log" \
    | grep -E "^\[|^  loads|load path|CPU \(cores\)" | tail -12
fi
if [[ $what == sustained ]]; then  # issue 41 (~2 min): the loads' own ceiling, no requests behind
  # them: 27 MB q/k/v/o registrations at 150/s for 4 s while 32 streams decode (the running
  # streams' gaps against the window before; "images packed" / s is the rate)
  python3 -m benchmarks.storm --storms --sustained 150 4 --max-cpu-loras 128 "$@" 2>&1 \
    | grep -v -E "^\[|\[(info|warn)" | tee "$OUT/sustained.log" | grep -E "^\| |sustained" | tail -12
fi
if [[ $what == moe ]]; then  # issue 42 in one call (~6 min): MoE kernels (bfloat16 too), the PEFT
  # oracle with expert adapters on CUDA (graphs), decode with 0 / 8 rank-16 attention + expert adapters
  python3 -m pytest -q -p no:cacheprovider tests/model/test_moe_kernels.py tests/model/test_moe_expert_lora.py \
    tests/model/test_moe_expert_writes.py \
    tests/engine/test_moe_graphs.py 2>&1 | tee "$OUT/moe_tests.log" | grep -E "passed|failed|Error|^E " | tail -12
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_moe_oracle.py 2>&1 | tee "$OUT/moe_oracle.log" \
    | grep -E "passed|failed|Error|^E " | tail -8
  # 24 of the 48 layers: 8 slots of expert LoRA at all 48 take ~13 GB beside ~61 GB of weights
  python3 -m benchmarks.moe_decode --expert-lora --layers 24 --adapters 0 8 --batches 1 64 \
    --append "$OUT/moe_decode.md" "$@" 2>&1 | grep -v "\[info" | tee "$OUT/moe_decode.log" | tail -16
fi
if [[ $what == moe_configs ]]; then  # issue 42 (~6 min): launch configs of the expert LoRA
  # kernels and the base grouped GEMM at the Qwen3-30B-A3B decode shapes, each checked against
  # its torch twin first
  python3 -m benchmarks.moe_configs --append "$OUT/moe_configs.md" "$@" 2>&1 \
    | tee "$OUT/moe_configs.log" | grep -E "^\||Error" | tail -12
fi
if [[ $what == spec ]]; then  # issue 45 (~6 min): the speculation tests on the device (CUDA
  # kernels under verify rows), then the step economics on the 8B shape with 8 adapters
  python3 -m pytest -q -p no:cacheprovider tests/spec 2>&1 | tee "$OUT/spec_tests.log" \
    | grep -E "passed|failed|Error|^E " | tail -10
  python3 -m benchmarks.spec_decode --append "$OUT/spec_decode.md" "$@" 2>&1 | grep -v "\[info" \
    | tee "$OUT/spec_decode.log" | tail -40
fi
