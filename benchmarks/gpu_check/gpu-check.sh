#!/usr/bin/env bash
# `make gpu-check`: on the GPU machine (no network), install the kit made by `make gpu-kit`, then run every
# part of the check (python -m benchmarks.gpu_check). GPU_CHECK_DRY=1 runs the same parts here on the CPU
# with the project's venv. Arguments go to the check (e.g. --parts numerics).
set -uo pipefail
cd "$(dirname "$0")/../.."
KIT=${GPU_KIT:-.gpu-kit}
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  exec "${PYTHON:-.venv/bin/python}" -m benchmarks.gpu_check --dry "$@"
fi
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/elastictrain-site}
if ! ls "$KIT"/wheels/*.whl >/dev/null 2>&1; then
  echo "gpu-check: no kit in $KIT/wheels: run 'make gpu-kit' where pip reaches PyPI, and bring $KIT along" >&2
  exit 2
fi
start=$(date +%s)
# As the GPU machine's own README says: no index, no dependencies resolved there, one version of each.
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$KIT"/wheels/*.whl || exit 2
export PYTHONPATH="$SITE:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
# DeepSpeed's async I/O op (NVMe offload) compiles against libaio: the kit carries it for a machine without.
if [ ! -e /usr/include/libaio.h ] && ls "$KIT"/debs/*.deb >/dev/null 2>&1; then
  AIO=/tmp/elastictrain-libaio
  for deb in "$KIT"/debs/*.deb; do dpkg -x "$deb" "$AIO"; done
  LIB=$AIO/usr/lib/x86_64-linux-gnu
  [ -e "$LIB/libaio.so" ] || ln -sf libaio.so.1 "$LIB/libaio.so"
  export CPATH="$AIO/usr/include${CPATH:+:$CPATH}" LIBRARY_PATH="$LIB${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CFLAGS="-I$AIO/usr/include ${CFLAGS:-}" LDFLAGS="-L$LIB ${LDFLAGS:-}"
  echo "gpu-check: libaio from the kit in $AIO"
fi
echo "gpu-check: kit installed into $SITE in $(( $(date +%s) - start ))s"
exec "$PY" -m benchmarks.gpu_check "$@"
