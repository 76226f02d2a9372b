#!/usr/bin/env bash
# Everything the GPU machine checks, in one call: GPU tests, then the benchmarks. Logs go to $OUT.
# On the device: carry .whl (wheels for packages missing there, e.g. textual, gguf) and run this script.
set -uo pipefail
OUT=${OUT:-/tmp/localllm-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LOCALLLM_PROGRESS=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
# no usable GPU (none, no CuPy): one line, not a screen of failed GPU tests
why=$(python3 -c "from localllm.kernels import cuda; print(cuda.unusable() or '')") || exit 1
if [ -n "$why" ]; then echo "gpu_check.sh runs the GPU tests and benchmarks, and cannot here: $why" >&2; exit 2; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
# optional arguments: which benchmarks (localllm.bench: gemv, gemv-lut, gemv-sweep, e2e, demo, breakdown, qdec, e2e-qdec, tune,
# prefill, kv, kv-ppl, quantize; --kv-bits 8|4 for the decoders of e2e, demo, breakdown, e2e-qdec);
# GPU_TESTS=0 skips the tests, BENCH=0 the benchmarks; TESTS="tests/test_gpu_qdec.py ..." runs those files only
tests_rc=0
# without textual (not on the device unless its wheels are carried) the chat UI's tests cannot be collected: leave
# them out, and say so, rather than stop the whole run at collection
ignore=""
if ! python3 -c "import textual" 2>/dev/null; then
  ignore="--ignore=tests/test_tui.py --ignore=tests/test_tui_app.py"
  echo "textual is not installed: the chat UI's tests are left out (carry its wheels in .whl to run them)"
fi
if [ "${GPU_TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu -q -p no:cacheprovider $ignore ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.txt"
  tests_rc=${PIPESTATUS[0]}
  # again as an RTX 40 runs: plain launches (no programmatic dependent launch, no clusters) and 99 KB of shared memory
  # a block (the variants chosen and the kernels compiled for it). GPU_TESTS_NO_PDL=0 skips this pass.
  if [ "${GPU_TESTS_NO_PDL:-1}" = 1 ]; then
    # shellcheck disable=SC2086
    LOCALLLM_NO_PDL=1 LOCALLLM_SHARED_LIMIT=101376 python3 -m pytest -m gpu -q -p no:cacheprovider $ignore ${TESTS:-tests} 2>&1 \
      | tee "$OUT/gpu_tests_no_pdl.txt"
    tests_rc=$(( tests_rc | PIPESTATUS[0] ))
  fi
fi
bench_rc=0
if [ "${BENCH:-1}" = 1 ]; then  # BENCH=0: the tests only
  python3 -m localllm.bench "$@" 2>&1 | tee "$OUT/bench.txt"
  bench_rc=${PIPESTATUS[0]}
fi
# REPORT=DIR (a report made on a CPU, e.g. docs/report-demo): add the GPU sections of `localllm report` to it, with
# REPORT_ARGS for its model and settings (as its report.md states), and bring the folder back as $OUT/report.tgz
report_rc=0
if [ -n "${REPORT:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m localllm.cli report ${REPORT_ARGS:-} --out "$REPORT" --sections kernel,pareto --update 2>&1 \
    | tee "$OUT/report.txt"
  report_rc=${PIPESTATUS[0]}
  tar czf "$OUT/report.tgz" -C "$(dirname "$REPORT")" "$(basename "$REPORT")"
fi
echo "gpu tests rc=$tests_rc bench rc=$bench_rc report rc=$report_rc"
exit $(( tests_rc | bench_rc | report_rc ))
