# int8 wide A/B at B = 16, 32K, Γ = 5 (H200), the kernel profile, the headline contexts, the GPU tests of the change
set -u
export PYTHONUNBUFFERED=1 GIT_SHA=${GIT_SHA:-unset}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
mkdir -p $OUT/z
e=(python3 benchmarks/bench_e2e.py --pair llama-8b --budget 2048 --rounds 12 --tau 2.7 --batches 16 --gamma 5
   --ring-head-ids 32768 --ring-weights int8 --tau-ratios dustin-ip-ring=1.084)
run() { name=$1; shift; (timeout ${T:-150} "$@" --out $OUT/z/$name.json > $OUT/z/$name.log 2>&1) || echo "$name exit $?"; grep -h "'method': '\(dustin\|vanilla\)" $OUT/z/$name.log | cut -c1-110; grep -ho "'phase_ms_per_round': {[^}]*}" $OUT/z/$name.log; }
for step in "$@"; do
  t0=$SECONDS
  case $step in
    ab) run wide_on "${e[@]}" --contexts ${CTX:-32768} --methods vanilla,dustin-ip-ring
        run wide_off "${e[@]}" --contexts ${CTX:-32768} --methods vanilla,dustin-ip-ring --int8-wide off ;;
    ab2) run wide_on2 "${e[@]}" --contexts ${CTX:-32768} --methods dustin-ip-ring
         run wide_off2 "${e[@]}" --contexts ${CTX:-32768} --methods dustin-ip-ring --int8-wide off ;;
    prof) run prof "${e[@]}" --contexts ${CTX:-32768} --methods dustin-ip-ring --profile-kernels ;;
    head) T=300 run headline "${e[@]}" --contexts 8192,16384,24576,32768 --methods vanilla,dustin-ip-ring ;;
    tests) timeout 300 python3 -m pytest -q -n 0 tests/test_quantize.py tests/test_kernel_config.py tests/test_ring_drafter.py \
             > $OUT/z/gpu_tests.txt 2>&1 || echo "tests exit $?"; tail -n 2 $OUT/z/gpu_tests.txt ;;
  esac
  echo "== $step $((SECONDS - t0)) s"
  tar czf $OUT/z_$step.tgz -C $OUT/z .
done
rm -rf $OUT/z
