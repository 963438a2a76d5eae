# Continue training the packaged ring drafter (second cosine), then tau of the new and the packaged one as
# dustin-ip-ring at Γ = 5 (int8, k = 2048) and of the AR draft at Γ = 3, on the same windows. Needs ~/stash from
# device_session.sh stash of .carry/s1, s2, s4.
set -u
S=~/stash; L=~/ls13; Z=$L/out; mkdir -p $Z
export PYTHONUNBUFFERED=1 GIT_SHA=$(cat $S/git_sha)
trap 'tar czf $OUT/train13.tgz -C $Z .' EXIT
mkdir -p trtllm_dustin/weights && cp -r $S/smollm2_ring $S/smollm2_draft trtllm_dustin/weights/
bash benchmarks/run_longspark2_h200.sh setup > /dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $Z/gpu.txt
t0=$SECONDS
timeout ${TRAIN_T:-460} python3 -m trtllm_dustin.cli train-ring-drafter --tokens $S/tokens.npy --out $L/ring \
  --max-seconds ${SECS:-400} --init smollm2-ring --seed 1 --lr ${LR:-3e-4} > $Z/train.log 2>&1 || echo "train exit $?"
echo "train $((SECONDS - t0)) s"; tail -c 300 $Z/train.log | tr '\r' '\n' | tail -3
tau() { name=$1; shift; timeout ${TAU_T:-180} python3 benchmarks/eval_tau.py --prompts $S/test_prompts.npz --contexts 4096 8192 \
  --temperatures 0 1 --docs 24 --families books essays code fortunes "$@" --out $Z/tau_$name.json > $Z/tau_$name.log 2>&1 & }
tau new --methods dustin-ip-ring --gammas 5 --budgets 2048 --ring-weights int8 --ring $L/ring/checkpoint
tau old --methods dustin-ip-ring --gammas 5 --budgets 2048 --ring-weights int8
tau ar --methods classic --gammas 3
wait
cp $L/ring/training_record.json $L/ring/loss_curve.png $L/ring/checkpoint/*.json $Z/ 2>/dev/null
sha256sum $L/ring/checkpoint/model.safetensors > $Z/model.safetensors.sha256
split -b 15M -d -a 1 $L/ring/checkpoint/model.safetensors $OUT/ring_weights.
tail -n 3 $Z/tau_*.log
