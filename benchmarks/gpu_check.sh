#!/usr/bin/env bash
# The GPU check on a lent CUDA machine (no internet there): install the carried wheels that the
# machine's image lacks, then run benchmarks/gpu_check.py. Prepare the wheels here first with
#   PY=.venv/bin/python bash benchmarks/gpu_check.sh --download   (writes .whl/, ignored by git; carry it)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="gguf==0.19.0 llguidance==1.9.1"
if [ "${1:-}" = "--download" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  "${PY:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $WHEELS
  exit 0
fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 FITSERVE_HOME=${FITSERVE_HOME:-/tmp/fitserve-home}
python3 benchmarks/gpu_check.py "$@"
