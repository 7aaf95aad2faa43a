#!/usr/bin/env bash
# The accelerator checks in one run, for a GPU host with this project installed (see
# docs/backends.md): the real-hardware test cells, the fused LM head against materialised
# logits (both fused paths, the four sizes of the issue, then whole engines), and the host
# syncs of a training step, padded and packed, with the head's tile loops and without.
# Prints everything; asserts nothing beyond the tests. Sized for about 10 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
status=0
run() {
    echo "== $*"
    "$@" || status=$?
}
run "$py" -m pytest -q -p no:cacheprovider -m cuda tests/test_real_hardware.py
run "$py" -m benchmarks.lm_head_memory --device cuda --rounds 5
run "$py" -m benchmarks.lm_head_memory --engine --device cuda --sequences 16 --length 1024
run "$py" -m benchmarks.host_syncs
run "$py" -m benchmarks.host_syncs --packing
run "$py" -m benchmarks.host_syncs --fused-min-logits 0
run "$py" -m benchmarks.host_syncs --packing --fused-min-logits 0
exit "$status"
