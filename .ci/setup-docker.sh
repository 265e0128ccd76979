#!/usr/bin/env bash
# Prepare Docker for the test suite on a fresh Debian bookworm machine (run as root; idempotent).
#
#   - installs docker.io, docker-compose (v1, Debian), debootstrap and redis-server when missing
#   - starts dockerd in the background when no daemon answers, and waits for `docker info`
#   - builds the stand-in base images (redis:7, python:3.11-slim, haproxy:2.6) when they are missing
#   - collects the wheels the Sluice images install into deploy/wheels/ (offline docker build:
#     containers here cannot reach PyPI, only the host's pip can)
#
# DESIGN.md section 5 explains why: Docker Hub is unreachable here.
# Environment: SLUICE_SKIP_STANDINS=1 skips the stand-in build, SLUICE_SKIP_WHEELS=1 the wheels;
# DOCKERD_LOG (default /var/log/sluice-dockerd.log) is where the daemon's output goes.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
log() { printf '[setup-docker %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

need=()
command -v docker >/dev/null 2>&1 || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
if [ "${#need[@]}" -gt 0 ]; then
    log "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q "${need[@]}"
fi

if ! docker info >/dev/null 2>&1; then
    if [ -S /var/run/docker.sock ] && command -v systemctl >/dev/null 2>&1 \
        && systemctl is-system-running >/dev/null 2>&1; then
        log "starting docker via systemd"
        $SUDO systemctl start docker || true
    fi
fi
if ! docker info >/dev/null 2>&1; then
    if pgrep -x dockerd >/dev/null 2>&1; then
        log "dockerd is running but not answering yet; waiting"
    else
        logfile="${DOCKERD_LOG:-/var/log/sluice-dockerd.log}"
        # A daemon killed at the end of an earlier session may have left its pid files behind.
        $SUDO rm -f /var/run/docker.pid /var/run/docker/containerd/containerd.pid
        log "starting dockerd in the background (log: $logfile)"
        # setsid: the daemon outlives this script and the CI step that ran it.
        $SUDO setsid nohup dockerd >"$logfile" 2>&1 </dev/null &
    fi
    for _ in $(seq 1 120); do
        if docker info >/dev/null 2>&1; then break; fi
        sleep 0.5
    done
fi
if ! docker info >/dev/null 2>&1; then
    log "docker daemon did not come up; last lines of its log:"
    tail -n 30 "${DOCKERD_LOG:-/var/log/sluice-dockerd.log}" >&2 || true
    exit 1
fi
log "docker $(docker version --format '{{.Server.Version}}') is up ($(docker-compose version --short 2>/dev/null || echo 'no compose v1'))"

if [ "${SLUICE_SKIP_STANDINS:-0}" != 1 ]; then
    "$repo/deploy/images/build-standins.sh"
fi
if [ "${SLUICE_SKIP_WHEELS:-0}" != 1 ]; then
    "$repo/deploy/images/collect-wheels.sh"
fi
