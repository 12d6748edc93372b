#!/usr/bin/env bash
# One GPU session in one command: the CUDA-only tests, then the whole suite; everything lands in $OUT.
#
#   OUT=out LEVERS_COMMIT=abc1234 bash bench/gpu_run.sh [extra gpu_suite.py arguments]
#
# Optional, each used only when present (none is committed; see bench/README.md):
#   .whl/*.whl        PyPI wheels the machine lacks (bitsandbytes, torchao, comfy-aimdo, ...), put on
#                     PYTHONPATH through a private --target folder, never into the system site-packages
#   .comfy/pollockjj  a ComfyUI 0.8-era checkout: the legacy lowvram baseline and PhaseOffload inside ComfyUI
#   .comfy/yzkee      a ComfyUI 0.15+ checkout: the DynamicVRAM baseline
#   .comfy/site       import-only stand-ins ComfyUI needs on a bare machine
#   .comfy/gguf       a ComfyUI-GGUF checkout (with the gguf wheel in .whl/): GroupPrefetch on a GGUF model
# The CUDA tests get at most 230 s (typically ~60 s); the suite gets what is left of 570 s (at most 450 s).
set -u
T0=$(date +%s)      # before the wheel install: the device tool's 600 s count the whole command
OUT=${OUT:-out}
mkdir -p "$OUT"
SHA=${LEVERS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
SITE=/tmp/levers-site
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || echo "warning: installing .whl/ failed; the sections that need those wheels will say so"
fi
PK=/tmp/levers-pk
mkdir -p "$PK" && ln -sfn "$PWD" "$PK/comfyui_levers"
export PYTHONPATH="$PK:$SITE${PYTHONPATH:+:$PYTHONPATH}"
[ -d .comfy/site ] && export PYTHONPATH="$PYTHONPATH:$PWD/.comfy/site"
[ -f .comfy/gguf/nodes.py ] && export COMFYUI_GGUF_PATH="$PWD/.comfy/gguf"
[ -d .comfy/gguf ] && [ ! -f .comfy/gguf/nodes.py ] && echo "warning: .comfy/gguf has no nodes.py (copy the checkout's root, e.g. comfyui_gguf/): the GGUF case will skip"
export PYTHONUNBUFFERED=1
# What ComfyUI's imports need that the machine may lack (0.8: torchsde, PyAV's name; 0.33: comfy_aimdo,
# comfy_kitchen; GGUF: gguf): one line each in preflight.txt, so a section that fails on an import is explained
# before it runs (bench/README.md, "What the device needs", says where each comes from)
python3 - > "$OUT/preflight.txt" 2>&1 <<'PY'
import importlib
for name in ("torch", "torchsde", "av", "sentencepiece", "comfy_kitchen", "comfy_aimdo", "gguf", "matplotlib"):
    try:
        m = importlib.import_module(name)
        print(f"{name}: ok ({getattr(m, '__file__', None)})")
    except Exception as e:
        print(f"{name}: MISSING ({type(e).__name__}: {e})")
PY
grep MISSING "$OUT/preflight.txt" || echo "preflight: every import ComfyUI needs is there"

# The device tool cuts a command at 600 s: the tests and the suite share LIMIT (570 s, leaving room to write out).
LIMIT=${LEVERS_LIMIT_S:-570}
# the inductor test compiles first in the process and is the slowest: it runs last, so a slow compile cannot
# cut the other CUDA checks
timeout 110 python3 -m pytest tests -q -m cuda -k "not inductor" -p no:cacheprovider > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests: exit $? (log in $OUT/cuda-tests.log)"
tail -3 "$OUT/cuda-tests.log"
# its own file only: collecting all of tests/ again costs seconds of this test's budget before inductor even starts
timeout 60 python3 -m pytest tests/test_prefetch_schedule.py -q -m cuda -k inductor -p no:cacheprovider \
    > "$OUT/cuda-inductor.log" 2>&1
echo "cuda inductor test: exit $? (log in $OUT/cuda-inductor.log)"
tail -3 "$OUT/cuda-inductor.log"
# PhaseOffload's engine numbers on a 4 GiB bf16 stack (the README's "Measured" table): raw pinned copy, onload
# pinned and pageable, apply (page-locking) seconds
timeout 60 python3 tests/test_phase_cuda.py --gib 4 > "$OUT/phase-cuda-bench.json" 2> "$OUT/phase-cuda-bench.log"
echo "phase engine bench: exit $? ($OUT/phase-cuda-bench.json)"
LEFT=$(( LIMIT - ($(date +%s) - T0) - 70 ))      # 70 s: the suite's start-up, its watchdog grace and the plot
[ "$LEFT" -gt 450 ] && LEFT=450

ARGS=(--out "$OUT" --time-budget "$LEFT")
[ "$SHA" != unknown ] && ARGS+=(--commit "$SHA")     # else the suite records its source fingerprint, not "unknown"
[ -d .comfy/pollockjj ] && ARGS+=(--comfyui .comfy/pollockjj)
[ -d .comfy/yzkee ] && ARGS+=(--comfyui-dynamic .comfy/yzkee)
# the whole console (warnings, comfy_phase's lines) in its own file: the suite itself appends to suite.log, and two
# writers on one file leave it garbled
python3 bench/gpu_suite.py "${ARGS[@]}" "$@" 2>&1 | tee "$OUT/suite-console.log" | grep -E "^\[.*(==|summary|wrote)"
