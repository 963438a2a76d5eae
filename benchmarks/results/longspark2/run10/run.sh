# The script that ran here: run9/run.sh with the ring's Γ a variable G (default 7) in its ring, ring-model, long and
# cost steps, made by the sed below (run in the repository root, as run9/run.sh is):
#   GIT_SHA=67c091c BATCH=16 bash run.sh tests g5 ring default
#   GIT_SHA=67c091c BATCH=16 G=5 B64=8 B128=4 bash run.sh long
bash <(sed 's/ring=(--gamma 7/ring=(--gamma ${G:-7}/' "$(dirname "$0")/../run9/run.sh") "$@"
