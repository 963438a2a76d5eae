# B = 16, 32K on the H200 at the committed SHA: the shipped default and the ring method, model / int8 / int8 without
# the int8 table (the fallback of before), then the ring method in int8 at 64K (B = 8) and 128K (B = 4)
set -u
export PYTHONUNBUFFERED=1 GIT_SHA=8e927bf
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null
echo '{"schema_version": 1, "weights": "int8", "gpu": "none: no entries, every int8 call takes the fallback", "entries": []}' > ~/empty_int8.json
mkdir -p $OUT/x
case $(nvidia-smi --query-gpu=name --format=csv,noheader) in *H200*) B=16 ;; *) B=8 ;; esac
e2e=(python3 benchmarks/bench_e2e.py --pair llama-8b --budget 2048 --rounds 12 --tau 2.7)
ring=(--gamma 7 --tau-ratios dustin-ip-ring=1.154 --ring-head-ids 32768 --methods vanilla,dustin-ip-ring)
dflt=(--gamma 3 --tau-ratios dustin-ip-sparse-draft=0.983 --methods vanilla,dustin-ip-sparse-draft)
run() { name=$1; shift; timeout 100 "$@" --out $OUT/x/$name.json > $OUT/x/$name.log 2>&1 || echo "$name exit $?"; grep -h "'method': 'dustin" $OUT/x/$name.log | cut -c1-110; }
for w in model int8; do
  run default_$w "${e2e[@]}" "${dflt[@]}" --batches $B --contexts 32768 --draft-weights $w
  run ring_$w "${e2e[@]}" "${ring[@]}" --batches $B --contexts 32768 --ring-weights $w
done
TRTLLM_DUSTIN_INT8_LINEAR_TACTICS=~/empty_int8.json run default_int8_untuned "${e2e[@]}" "${dflt[@]}" --batches $B --contexts 32768 --draft-weights int8
TRTLLM_DUSTIN_INT8_LINEAR_TACTICS=~/empty_int8.json run ring_int8_untuned "${e2e[@]}" "${ring[@]}" --batches $B --contexts 32768 --ring-weights int8
[ $B = 16 ] && run ring_int8_64k "${e2e[@]}" "${ring[@]}" --batches 8 --contexts 65536 --ring-weights int8
[ $B = 16 ] && run ring_int8_128k "${e2e[@]}" "${ring[@]}" --batches 4 --contexts 131072 --ring-weights int8
tar czf $OUT/x.tgz -C $OUT x && rm -r $OUT/x; ls -la $OUT
