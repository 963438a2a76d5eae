# issue 38 groundwork on the H200: the amended batched-prefill GPU test, and regenerate-data's throughput at
# SmolLM2-135M's shapes (random weights: the speed of the real target, not its text) on 4096-token windows.
set -uo pipefail
export PYTHONUNBUFFERED=1 GIT_SHA=$(cat .carry/s/sha)
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || { echo "editable install failed"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader; echo "tree $GIT_SHA"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_batched_prefill.py 2>&1 | tail -2
python3 -c "import numpy as np; np.save('/tmp/win.npy', np.random.default_rng(0).integers(2, 49152, (128, 4096)).astype(np.uint16))"
for b in 16 64; do
  t=$(date +%s.%N)
  timeout 200 trtllm-dustin regenerate-data --tokens /tmp/win.npy --out $OUT/regen_b$b.npy --new 512 --batch-size $b \
    --target preset:smollm2-135m --device cuda > $OUT/regen_b$b.log 2>&1; echo "rc $?"
  echo "batch $b: $(python3 -c "print(round($(date +%s.%N) - $t, 1))") s wall"; tail -3 $OUT/regen_b$b.log | head -2
  rm -f $OUT/regen_b$b.npy
done
ls $OUT
