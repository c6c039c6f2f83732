#!/usr/bin/env bash
# `make image-test`: run the image as users will, on this machine's Docker engine.
#
# A Ray head and two worker containers on a user-defined network, token auth on, running as the
# image's non-root user; the run folder on a shared Docker volume (what a ReadWriteMany claim is on
# Kubernetes). From the host: `ray job submit` of the tiny run to the dashboard, published on
# 127.0.0.1 only; then `docker kill` of a worker (the run must shrink and go on), `docker run` of a new
# worker (it must grow back), and the job must end SUCCEEDED. Needs root (Docker) and a few minutes.
set -euo pipefail
IMAGE=${1:-elastictrain:0.1.0-cpu}
P=${ET_PREFIX:-et-imagetest}
NET=$P-net
VOL=$P-runs
PORT=${ET_DASHBOARD_PORT:-8265}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RAY=${RAY:-$(command -v ray || echo "$ROOT/.venv/bin/ray")}
PY=${PYTHON:-$(dirname "$RAY")/python}
TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(32))')
JOB=$P-$(date +%s)
T0=$(date +%s)

say() { printf '%s +%4ss %s\n' "$(date -u +%H:%M:%S)" "$(($(date +%s) - T0))" "$*"; }
fail() { say "FAILED: $*"; exit 1; }
cleanup() {
  docker rm -f "$P-head" "$P-w1" "$P-w2" "$P-w3" >/dev/null 2>&1 || true
  docker network rm "$NET" >/dev/null 2>&1 || true
  docker volume rm "$VOL" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM # so that the EXIT trap removes the containers
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$TOKEN # the host's ray CLI authenticates with the token

docker image inspect "$IMAGE" >/dev/null 2>&1 || fail "no image $IMAGE: run make image first"
cleanup
docker network create "$NET" >/dev/null
docker volume create "$VOL" >/dev/null
docker run --rm --user 0 -v "$VOL:/mnt/runs" "$IMAGE" chown 1000:1000 /mnt/runs
# Each container JIT-builds DeepSpeed's CPU ops on first use, as a pod does (a shared build folder
# would let one container load a half-built op of another).
COMMON=(--network "$NET" --shm-size=1g -v "$VOL:/mnt/runs" -e RAY_AUTH_MODE=token -e "RAY_AUTH_TOKEN=$TOKEN"
        -e DS_ACCELERATOR=cpu -e RAY_memory_monitor_refresh_ms=0)
# Memory limits, as pods have; the kernel enforces them. Ray's own memory monitor is off: here
# (cgroup v1) it counted the page cache and killed actors at "95% of the container's memory" while
# they used 0.3 GiB, and without limits it watched the whole shared machine.
worker() {
  docker run -d --name "$1" --hostname "$1" --memory=4g "${COMMON[@]}" "$IMAGE" \
    ray start --address="$P-head:6379" --num-cpus=1 --block >/dev/null
}
say "starting the head (no CPUs: workers train in the worker containers) and 2 workers on network $NET"
docker run -d --name "$P-head" --hostname "$P-head" --memory=4g -p "127.0.0.1:$PORT:8265" "${COMMON[@]}" "$IMAGE" \
  ray start --head --num-cpus=0 --port=6379 --dashboard-host=0.0.0.0 --block >/dev/null
worker "$P-w1"
worker "$P-w2"

for c in "$P-head" "$P-w1" "$P-w2"; do
  uid=$(docker exec "$c" id -u)
  [ "$uid" = 1000 ] || fail "$c runs as uid $uid, not the non-root 1000 the manifests expect"
done
say "containers run as uid 1000 (non-root)"

code() { "$PY" - "$1" <<'PYEOF'
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)
except urllib.error.HTTPError as e:
    print(e.code)
except OSError:
    print(0)
PYEOF
}
for _ in $(seq 1 120); do
  [ "$(code "http://127.0.0.1:$PORT/api/version")" != 0 ] && break
  sleep 1
done
[ "$(code "http://127.0.0.1:$PORT/api/jobs/")" = 401 ] || [ "$(code "http://127.0.0.1:$PORT/api/jobs/")" = 403 ] \
  || fail "the dashboard answers the job API without the token ($(code "http://127.0.0.1:$PORT/api/jobs/"))"
say "dashboard on 127.0.0.1:$PORT refuses the job API without the token"
for _ in $(seq 1 120); do
  n=$(docker exec "$P-head" ray status 2>/dev/null | grep -c "node_" || true)
  [ "$n" -ge 3 ] && break
  sleep 2
done
say "Ray cluster up: $(docker exec "$P-head" ray status 2>/dev/null | grep -E '^ *[0-9.]+/[0-9.]+ CPU' | head -1 | xargs)"

# A global batch of 240 (10x the tiny default) makes steps slow enough that the new worker, which
# starts Ray, imports and builds DeepSpeed's ops, joins before the last step.
say "ray job submit $JOB (from the host, with the token)"
"$RAY" job submit --address "http://127.0.0.1:$PORT" --submission-id "$JOB" --no-wait -- \
  elastictrain train run.dir=/mnt/runs/tiny training.max_steps=${ET_STEPS:-100} checkpoint.every_steps=4 \
  training.global_batch_size=240 scaling.min_workers=1 scaling.max_workers=2 failure.wait_for_capacity_s=300 \
  >/dev/null

logs() { "$RAY" job logs --address "http://127.0.0.1:$PORT" "$JOB" 2>/dev/null || true; }
status() { # PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED (the CLI prints it in words)
  "$PY" -c 'import sys; from ray.job_submission import JobSubmissionClient as C
print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)' "http://127.0.0.1:$PORT" "$JOB" 2>/dev/null || true
}
wait_log() { # pattern, what, seconds
  for _ in $(seq 1 "$3"); do
    if logs | grep -qE "$1"; then return 0; fi
    st=$(status)
    case "$st" in SUCCEEDED|FAILED|STOPPED) logs | tail -40; fail "the job ended $st before $2" ;; esac
    sleep 1
  done
  logs | tail -40
  fail "no $2 in $3 s"
}
wait_log "world size 2 \(" "attempt at world size 2" 600
wait_log "^step ([89]|[1-9][0-9]+)/" "step 8" 300
say "training at world size 2; docker kill $P-w2"
docker kill "$P-w2" >/dev/null
wait_log "world size 1 \(" "shrink to world size 1" 300
say "shrank: $(logs | grep -E 'world size 1 \(' | tail -1 | cut -c1-150)"
say "docker run of a new worker $P-w3"
worker "$P-w3"
wait_log "attempt [0-9]+: world size 2 .*from step" "grow back to world size 2" 600
say "grew back: $(logs | grep -E 'attempt [0-9]+: world size 2 .*from step' | tail -1 | cut -c1-150)"
for _ in $(seq 1 900); do
  st=$(status)
  case "$st" in SUCCEEDED|FAILED|STOPPED) break ;; esac
  sleep 1
done
logs | grep -E "^(attempt|checkpoint|worker_died|node_lost|finished|run ended)|world size|failure" | cut -c1-160 | tail -25 || true
[ "${st:-}" = SUCCEEDED ] || { logs | tail -40; fail "job ended ${st:-unknown}"; }
owner=$(docker exec "$P-head" stat -c %u /mnt/runs/tiny/run.json)
[ "$owner" = 1000 ] || fail "run.json owned by uid $owner"
say "job $JOB SUCCEEDED; run folder written by uid $owner; world sizes: $(docker exec "$P-head" \
  python3 -c 'import json; print([h["world_size"] for h in json.load(open("/mnt/runs/tiny/run.json"))["world_size_history"]])' 2>/dev/null || echo '?')"
say "image test passed in $(($(date +%s) - T0)) s"
