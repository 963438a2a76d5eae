# The ring method at B = $BATCH (default 16), 32K, Llama-3.1-8B + 3.2-1B shapes, this tree; steps: tests (GPU tests of
# the ring drafter, its kernel and the in-pass tests), ring (int8 ring drafter), ring-model, default (the shipped
# dustin-ip-sparse-draft, model weights), default-int8, long (64K B=$B64, 128K B=$B128), cost (the int8 ring at a fixed batch
# $CB from 8K to 128K: acceptance 3's drafting cost). G: the ring's Γ in ring, ring-model, long and cost (default 7).
set -u
export PYTHONUNBUFFERED=1 GIT_SHA=${GIT_SHA:-unset}
B=${BATCH:-16}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
mkdir -p $OUT/z
e2e=(python3 benchmarks/bench_e2e.py --pair llama-8b --budget 2048 --rounds 12 --tau 2.7 --batches $B --contexts 32768)
ring=(--gamma ${G:-7} --ring-head-ids 32768 --methods vanilla,dustin-ip-ring)
r_model=(--tau-ratios dustin-ip-ring=1.154)  # the fifth run's pooled greedy ratio (h200_run5)
r_int8=(--tau-ratios dustin-ip-ring=1.147)   # x 1.160 / 1.167: run7's int8 / model ratio on the same windows
run() { name=$1; shift; (timeout ${T:-150} "$@" --out $OUT/z/$name.json > $OUT/z/$name.log 2>&1) || echo "$name exit $?"; grep -h "'method': '\(dustin\|vanilla\)" $OUT/z/$name.log | cut -c1-170; }
for step in "$@"; do
  t0=$SECONDS
  case $step in
    tests) timeout 300 python3 -m pytest -q -n 0 tests/test_plugins_ring_attention.py tests/test_ring_drafter.py \
             tests/test_in_pass.py > $OUT/z/gpu_tests.txt 2>&1 || echo "tests exit $?"; tail -n 3 $OUT/z/gpu_tests.txt ;;
    ring) run ring_int8 "${e2e[@]}" "${ring[@]}" "${r_int8[@]}" --ring-weights int8 ;;
    g[0-9]) run ring_int8_$step "${e2e[@]}" "${ring[@]}" "${r_int8[@]}" --ring-weights int8 --gamma ${step#g} ;;
    fixed) timeout 200 python3 -m pytest -q -n 0 tests/test_ring_drafter.py -k captured > $OUT/z/gpu_tests_fixed.txt 2>&1 || echo "fixed exit $?"; tail -n 2 $OUT/z/gpu_tests_fixed.txt ;;
    ring-model) run ring_model "${e2e[@]}" "${ring[@]}" "${r_model[@]}" --ring-weights model ;;
    default) run default_model "${e2e[@]}" --gamma 3 --tau-ratios dustin-ip-sparse-draft=0.983 --methods vanilla,dustin-ip-sparse-draft ;;
    default-int8) run default_int8 "${e2e[@]}" --gamma 3 --tau-ratios dustin-ip-sparse-draft=0.983 --methods vanilla,dustin-ip-sparse-draft --draft-weights int8 ;;
    long)
      lng=(python3 benchmarks/bench_e2e.py --pair llama-8b --budget 2048 --rounds 12 --tau 2.7)
      run ring_int8_64k "${lng[@]}" --batches ${B64:-8} --contexts 65536 "${ring[@]}" "${r_int8[@]}" --ring-weights int8
      run ring_int8_128k "${lng[@]}" --batches ${B128:-4} --contexts 131072 "${ring[@]}" "${r_int8[@]}" --ring-weights int8 ;;
    cost) T=400 run ring_int8_fixed python3 benchmarks/bench_e2e.py --pair llama-8b --budget 2048 --rounds 12 --tau 2.7 \
            --batches ${CB:-4} --contexts 8192,16384,32768,65536,131072 "${ring[@]}" "${r_int8[@]}" --ring-weights int8 ;;
  esac
  echo "== $step $((SECONDS - t0)) s"
  tar czf $OUT/z_$step.tgz -C $OUT/z .
done
rm -rf $OUT/z
