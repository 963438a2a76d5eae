# one call: the stash's first part, then the int8 A/B at the committed SHA (B = 16 on an H200, B = 8 on an H100)
set -u
mkdir -p ~/stash && cp -r .carry/s1/. ~/stash/ && echo 9768872 > ~/stash/git_sha
export PYTHONUNBUFFERED=1 GIT_SHA=9768872
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
echo '{"schema_version": 1, "weights": "int8", "gpu": "none: no entries, every int8 call takes the fallback", "entries": []}' > ~/empty_int8.json
case $gpu in *H200*) B=16; ctx="65536:8 131072:4" ;; *) B=8; ctx="" ;; esac
BATCH=$B timeout 240 bash benchmarks/dev/device_session.sh int8 ring default tests > $OUT/int8_steps.log 2>&1; tail -2 $OUT/int8_steps.log
e2e=(python3 benchmarks/bench_e2e.py --pair llama-8b --budget 2048 --rounds 12 --tau 2.7 --gamma 7 --tau-ratios dustin-ip-ring=1.154 --ring-head-ids 32768 --methods vanilla,dustin-ip-ring)
mkdir -p $OUT/x
# the table's effect: int8 with no int8 entries (the fallback of before) in the same session
TRTLLM_DUSTIN_INT8_LINEAR_TACTICS=~/empty_int8.json timeout 100 "${e2e[@]}" --batches $B --contexts 32768 --ring-weights int8 --out $OUT/x/e2e_ring_int8_untuned.json > $OUT/x/e2e_ring_int8_untuned.log 2>&1 || echo "untuned exit $?"
for spec in $ctx; do c=${spec%:*}; b=${spec#*:}
  for w in model int8; do
    timeout 120 "${e2e[@]}" --batches $b --contexts $c --ring-weights $w --out $OUT/x/e2e_ring_${w}_$c.json > $OUT/x/e2e_ring_${w}_$c.log 2>&1 || echo "$c $w exit $?"
  done
done
grep -h "dustin-ip-ring'" $OUT/x/*.log | cut -c1-160
tar czf $OUT/x.tgz -C $OUT x && rm -r $OUT/x; ls -la $OUT
