#!/usr/bin/env bash
# The checks that need a GPU, as one short call on a lent device machine: the CUDA tests (pinned
# staging on a side stream, restores into device tensors), then benchmarks/restart.py with the model
# and AdamW state on the GPU. The device image has torch but not zstandard or blake3, and cannot
# download: fetch their wheels here first, into .gpu-wheels/ (ignored by git), and carry that folder.
#
#   bash benchmarks/gpu_check.sh --fetch          # here, once (GPU_PY: the device's Python, default 3.12)
#   device run: command "bash benchmarks/gpu_check.sh", carry [".gpu-wheels"], timeout_s 540
#
# What it writes lands under $OUT (the device tool brings that folder back): nvidia-smi.txt,
# cuda-tests.txt, restart-cuda.md (check the latter in under benchmarks/results/ with a note).
# DEVICE=cpu PARAMS_M=2 REPS=1 runs the same steps on a machine without a GPU (a dry run of this script).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
PY=${PYTHON:-python3}

if [ "${1:-}" = "--fetch" ]; then
  exec "$PY" -m pip download -q --python-version "${GPU_PY:-3.12}" --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" zstandard blake3
fi

OUT=${OUT:-$(mktemp -d)}
DEVICE=${DEVICE:-cuda}
echo "results in $OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/nvidia-smi.txt"

# Dependencies the image lacks, from the carried wheels (nothing is downloaded there).
"$PY" -m pip install -q --no-index --find-links "$WHEELS" zstandard blake3 || exit 1

# ckpt from this checkout without installing it (the image's setuptools may predate pyproject's
# fields): storage/ and cli/ are imported as ckpt_store.storage and ckpt_store.cli, as setup.py maps them.
SITE=$(mktemp -d)
mkdir -p "$SITE/ckpt_store"
ln -s "$PWD/storage" "$SITE/ckpt_store/storage"
ln -s "$PWD/cli" "$SITE/ckpt_store/cli"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The native codec kernels, built in place as pip would (without them ckpt uses its numpy kernels).
read -r INC SUFFIX < <("$PY" -c "import sysconfig as s; print(s.get_paths()['include'], s.get_config_var('EXT_SUFFIX'))")
cc -O3 -shared -fPIC -I"$INC" ckpt/codecs/_native.c -o "ckpt/codecs/_native$SUFFIX" || echo "native codec not built: numpy kernels"
"$PY" -c "import torch, ckpt; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"

status=0
"$PY" -m pytest -q -p no:cacheprovider -rs tests/ckpt/snapshot/test_cuda.py 2>&1 | tee "$OUT/cuda-tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
"$PY" benchmarks/restart.py --device "$DEVICE" --params-m "${PARAMS_M:-100}" --reps "${REPS:-3}" --saves 4 \
  --out "$OUT/restart-cuda.md" 2> "$OUT/restart-log.txt" || { status=1; tail -30 "$OUT/restart-log.txt"; }
exit $status
