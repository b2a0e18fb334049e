#!/usr/bin/env bash
# Everything a lent CUDA machine is for, in one command: the @pytest.mark.gpu tests (kernel
# correctness on the device), then the kernel benchmarks. Each step has its own time limit so a
# slow one cannot eat the others; logs, RESULTS.md and the results JSON land in OUTDIR.
#
#   bash benchmarks/gpu_check.sh OUTDIR tests decode e2e w4a16 norm int8-quick   # or: int8 (the full shape list)
#   (W4A16_TOKENS="1 4 16" limits the W4A16 rows; E2E_ARGS="--only llama" the end-to-end models)
set -u
out=${1:?usage: gpu_check.sh OUTDIR STEP...}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/gpu.txt"
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    tests) timeout "${TESTS_S:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 2>&1 | tee "$out/gpu_tests.log" ;;
    w4a16) timeout "${W4A16_S:-200}" python3 -m benchmarks.w4a16 ${W4A16_TOKENS:+--tokens $W4A16_TOKENS} --json benchmarks/results/w4a16.json 2>&1 | tee "$out/w4a16.log" ;;
    e2e) timeout "${E2E_S:-300}" python3 -m benchmarks.cuda_e2e ${E2E_ARGS:-} 2>&1 | tee "$out/cuda_e2e.log" ;;
    decode) timeout "${DECODE_S:-150}" python3 -m benchmarks.cuda_decode --json benchmarks/results/cuda_decode.json 2>&1 | tee "$out/cuda_decode.log" ;;
    norm) timeout "${NORM_S:-200}" python3 -m benchmarks.cuda_fused_norm 2>&1 | tee "$out/cuda_fused_norm.log" ;;
    int8-quick) timeout "${INT8_S:-200}" python3 -m benchmarks.cuda_int8 --quick 2>&1 | tee "$out/cuda_int8.log" ;;
    int8) timeout "${INT8_S:-540}" python3 -m benchmarks.cuda_int8 2>&1 | tee "$out/cuda_int8.log" ;;
    *) echo "gpu_check.sh: unknown step '$step' (tests, decode, e2e, w4a16, norm, int8-quick, int8)" >&2; exit 2 ;;
  esac
  echo "step $step: rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$out/gpu.txt"
done
cp benchmarks/RESULTS.md "$out/" 2>/dev/null
for f in w4a16 cuda_int8 cuda_e2e cuda_decode cuda_fused_norm; do cp "benchmarks/results/$f.json" "$out/" 2>/dev/null; done
true
