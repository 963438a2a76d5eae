# A/B of the ring drafter's fused path (this tree) against 2823de1's (the base: its two files, no ring kernel), same
# machine, B = $BATCH, 32K, Llama-3.1-8B + 3.2-1B shapes; steps: tests, new-int8, base-int8, new-model, base-model,
# profile (new, int8, --profile-kernels), default (new, the shipped method, model weights)
set -u
export PYTHONUNBUFFERED=1 GIT_SHA=${GIT_SHA:-unset}
B=${BATCH:-16}
nvidia-smi --query-gpu=name --format=csv,noheader
NEW=$(pwd)
if [ ! -d ~/base ]; then
  mkdir -p ~/base && cp -r . ~/base/ && rm -rf ~/base/.carry
  cp .carry/base/ring_drafter.py ~/base/trtllm_dustin/models/ring_drafter.py
  cp .carry/base/ring.py ~/base/runtime/drafters/ring.py
  rm -f ~/base/plugins/ring_attention.py ~/base/tests/test_plugins_ring_attention.py
fi
mkdir -p $OUT/z
use() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null); }
e2e=(python3 benchmarks/bench_e2e.py --pair llama-8b --budget 2048 --rounds 12 --tau 2.7 --batches $B --contexts 32768)
ring=(--gamma 7 --ring-head-ids 32768 --methods vanilla,dustin-ip-ring)
r_model=(--tau-ratios dustin-ip-ring=1.154)  # the fifth run's pooled greedy ratio (h200_run5)
r_int8=(--tau-ratios dustin-ip-ring=1.147)   # x 1.160 / 1.167: run7's int8 / model ratio on the same windows
run() { name=$1; dir=$2; shift 2; (cd "$dir" && timeout 120 "$@" --out $OUT/z/$name.json > $OUT/z/$name.log 2>&1) || echo "$name exit $?"; grep -h "'method': 'dustin" $OUT/z/$name.log | cut -c1-150; }
for step in "$@"; do
  case $step in
    tests) use "$NEW"; timeout 240 python3 -m pytest -q -n 0 tests/test_plugins_ring_attention.py tests/test_ring_drafter.py > $OUT/z/gpu_tests.txt 2>&1 || echo "tests exit $?"; tail -n 3 $OUT/z/gpu_tests.txt ;;
    new-int8) use "$NEW"; run ring_int8_new "$NEW" "${e2e[@]}" "${ring[@]}" "${r_int8[@]}" --ring-weights int8 ;;
    new-model) use "$NEW"; run ring_model_new "$NEW" "${e2e[@]}" "${ring[@]}" "${r_model[@]}" --ring-weights model ;;
    base-int8) use ~/base; GIT_SHA=2823de1 run ring_int8_base ~/base "${e2e[@]}" "${ring[@]}" "${r_int8[@]}" --ring-weights int8 ;;
    base-model) use ~/base; GIT_SHA=2823de1 run ring_model_base ~/base "${e2e[@]}" "${ring[@]}" "${r_model[@]}" --ring-weights model ;;
    profile) use "$NEW"; run ring_int8_profile "$NEW" "${e2e[@]}" "${ring[@]}" "${r_int8[@]}" --ring-weights int8 --profile-kernels ;;
    long) use "$NEW"
      lng=(python3 benchmarks/bench_e2e.py --pair llama-8b --budget 2048 --rounds 12 --tau 2.7)
      run ring_int8_64k "$NEW" "${lng[@]}" --batches ${B64:-8} --contexts 65536 "${ring[@]}" "${r_int8[@]}" --ring-weights int8
      run ring_int8_128k "$NEW" "${lng[@]}" --batches ${B128:-4} --contexts 131072 "${ring[@]}" "${r_int8[@]}" --ring-weights int8 ;;
    default) use "$NEW"; run default_model_new "$NEW" "${e2e[@]}" --gamma 3 --tau-ratios dustin-ip-sparse-draft=0.983 --methods vanilla,dustin-ip-sparse-draft ;;
    default-int8) use "$NEW"; run default_int8_new "$NEW" "${e2e[@]}" --gamma 3 --tau-ratios dustin-ip-sparse-draft=0.983 --methods vanilla,dustin-ip-sparse-draft --draft-weights int8 ;;
  esac
  tar czf $OUT/z_$step.tgz -C $OUT/z . 
done
rm -rf $OUT/z
ls -la $OUT
