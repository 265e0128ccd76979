#!/usr/bin/env bash
# Build same-named stand-ins for the public base images Sluice names, from Debian packages,
# for hosts that cannot reach Docker Hub (DESIGN.md section 5):
#
#   redis:7            Debian bookworm's redis-server (7.0), CMD redis-server --protected-mode no;
#                      also the Redis Cluster nodes and init job of compose's `cluster` profile
#   python:3.11-slim   Debian bookworm's python3 (3.11) with pip and venv; python/pip on PATH
#   prom/prometheus:v2.42.0  Debian bookworm's prometheus (2.42.0) and promtool, laid out like the
#                      official image (/bin/prometheus, /etc/prometheus, /prometheus, user nobody);
#                      compose's `monitoring` profile. Debian has no Grafana package: no stand-in.
#   haproxy:2.6        Debian bookworm's haproxy (2.6), run like the official image: user haproxy,
#                      `haproxy -W -db -f /usr/local/etc/haproxy/haproxy.cfg`
#
# Each image is built only when `docker image inspect` does not find it (FORCE=1 rebuilds).
# Both start from one debootstrapped bookworm minbase rootfs, cached as a tarball under
# $SLUICE_STANDIN_CACHE (default /var/cache/sluice-standins), so a second build skips debootstrap.
# Needs root, debootstrap and a reachable Debian mirror ($DEBIAN_MIRROR, default deb.debian.org).
#
# Usage: deploy/images/build-standins.sh [IMAGE...]     (default: every stand-in)
set -euo pipefail

CACHE="${SLUICE_STANDIN_CACHE:-/var/cache/sluice-standins}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
SUITE=bookworm
FORCE="${FORCE:-0}"
BASE_TAR="$CACHE/$SUITE-minbase.tar"

log() { printf '[standins %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (debootstrap and chroot need it)"
command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "the docker daemon is not answering"

ALL_IMAGES=("redis:7" "python:3.11-slim" "prom/prometheus:v2.42.0" "haproxy:2.6")
images=("$@")
[ "${#images[@]}" -gt 0 ] || images=("${ALL_IMAGES[@]}")

missing=()
for image in "${images[@]}"; do
    if [ "$FORCE" != 1 ] && docker image inspect "$image" >/dev/null 2>&1; then
        log "$image is present; skipping"
    else
        missing+=("$image")
    fi
done
[ "${#missing[@]}" -gt 0 ] || exit 0

workdirs=()
cleanup() {
    for d in "${workdirs[@]}"; do
        for m in proc dev/pts dev; do umount "$d/$m" 2>/dev/null || true; done
        rm -rf --one-file-system "$d"
    done
}
trap cleanup EXIT

# --- the shared base rootfs ------------------------------------------------------------------
build_base() {
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    mkdir -p "$CACHE"
    local root
    root="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    chmod 755 "$root"
    workdirs+=("$root")
    log "debootstrap $SUITE (minbase) from $MIRROR"
    local t0=$SECONDS
    debootstrap --variant=minbase --include=ca-certificates,netbase,tzdata \
        "$SUITE" "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -n 30 "$CACHE/debootstrap.log" >&2; die "debootstrap failed"; }
    cat >"$root/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
SOURCES
    # Keep images small the way the official Debian images do.
    cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
APT
    printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
        >"$root/etc/apt/apt.conf.d/docker-no-recommends"
    printf 'path-exclude /usr/share/doc/*\npath-include /usr/share/doc/*/copyright\npath-exclude /usr/share/man/*\npath-exclude /usr/share/locale/*\n' \
        >"$root/etc/dpkg/dpkg.cfg.d/docker-excludes"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/*/[!c]* \
        "$root"/usr/share/man/* "$root"/usr/share/locale/*
    tar -C "$root" --numeric-owner -cf "$BASE_TAR.tmp" .
    mv "$BASE_TAR.tmp" "$BASE_TAR"
    log "base rootfs cached at $BASE_TAR ($(du -h "$BASE_TAR" | cut -f1), $((SECONDS - t0)) s)"
}

# new_root: unpack the cached base into a fresh directory ($root), ready for chroot apt-get.
new_root() {
    root="$(mktemp -d "$CACHE/image.XXXXXX")"
    chmod 755 "$root"   # apt's _apt user reads the chroot's download folders
    workdirs+=("$root")
    tar -C "$root" --numeric-owner -xf "$BASE_TAR"
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"   # no service starts in the chroot
    chmod +x "$root/usr/sbin/policy-rc.d"
    mount -t proc proc "$root/proc"
}

chroot_apt() {
    local root="$1"; shift
    local aptlog="$CACHE/apt-$(basename "$root").log"
    if ! { chroot "$root" env DEBIAN_FRONTEND=noninteractive LC_ALL=C apt-get update -q \
           && chroot "$root" env DEBIAN_FRONTEND=noninteractive LC_ALL=C apt-get install -y -q "$@"; } \
           >"$aptlog" 2>&1; then
        tail -n 30 "$aptlog" >&2
        die "apt-get install $* failed in the chroot (log: $aptlog)"
    fi
    rm -f "$aptlog"
}

finish_root() {
    local root="$1"
    umount "$root/proc"
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/tmp/* \
        "$root"/var/log/apt/* "$root"/var/log/dpkg.log "$root/usr/sbin/policy-rc.d"
    : >"$root/etc/resolv.conf"
    find "$root/usr" -name '__pycache__' -type d -prune -exec rm -rf {} + 2>/dev/null || true
}

import_root() {
    local root="$1" image="$2"; shift 2
    tar -C "$root" --numeric-owner -c . | docker import "$@" \
        --message "Sluice stand-in for $image, built from Debian $SUITE packages" - "$image" >/dev/null
}

# --- redis:7 ---------------------------------------------------------------------------------
build_redis() {
    local root
    new_root
    chroot_apt "$root" redis-server
    # Sluice needs Redis >= 7: sharded pub/sub, and the Redis Cluster nodes of compose's `cluster`
    # profile announce hostnames (cluster-announce-hostname, cluster-preferred-endpoint-type).
    local v
    v="$(chroot "$root" redis-server --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')"
    [ "${v:-0}" -ge 7 ] || die "bookworm's redis-server is ${v:-unknown}, not 7 or later"
    mkdir -p "$root/data"
    cat >"$root/usr/local/bin/docker-entrypoint.sh" <<'SH'
#!/bin/sh
# Like the official image's entrypoint: options alone run redis-server, and redis-server started
# without a config file listens on every interface with protected mode off.
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
    set -- redis-server "$@"
fi
if [ "$1" = redis-server ]; then
    case " $* " in
        *" --protected-mode "*|*.conf*) ;;
        *) set -- "$@" --protected-mode no ;;
    esac
fi
exec "$@"
SH
    chmod +x "$root/usr/local/bin/docker-entrypoint.sh"
    finish_root "$root"
    import_root "$root" "redis:7" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'WORKDIR /data' \
        --change 'VOLUME /data' \
        --change 'EXPOSE 6379' \
        --change 'ENTRYPOINT ["docker-entrypoint.sh"]' \
        --change 'CMD ["redis-server", "--protected-mode", "no"]' \
        --change 'LABEL org.opencontainers.image.description=sluice-standin'
}

# --- python:3.11-slim ------------------------------------------------------------------------
build_python() {
    local root
    new_root
    chroot_apt "$root" python3 python3-pip python3-venv
    local v
    v="$(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    [ "$v" = 3.11 ] || die "bookworm's python3 is $v, not 3.11"
    ln -sf /usr/bin/python3 "$root/usr/local/bin/python3"
    ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
    ln -sf /usr/bin/python3 "$root/usr/local/bin/python3.11"
    ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip"
    ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip3"
    # PEP 668: let `pip install` in a Dockerfile work as it does in the official image.
    rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
    local full
    full="$(chroot "$root" python3 -c 'import platform; print(platform.python_version())')"
    finish_root "$root"
    import_root "$root" "python:3.11-slim" \
        --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change "ENV PYTHON_VERSION=$full" \
        --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
        --change 'CMD ["python3"]' \
        --change 'LABEL org.opencontainers.image.description=sluice-standin'
}

# --- prom/prometheus:v2.42.0 -------------------------------------------------------------------
build_prometheus() {
    local root
    new_root
    chroot_apt "$root" prometheus
    local v
    v="$(chroot "$root" prometheus --version 2>&1 | head -n 1)"
    case "$v" in *" 2.42."*) ;; *) die "bookworm's prometheus is not 2.42: $v" ;; esac
    # /bin is /usr/bin in bookworm (merged /usr); link only where it is not
    for tool in prometheus promtool; do
        [ -e "$root/bin/$tool" ] || ln -s "/usr/bin/$tool" "$root/bin/$tool"
    done
    mkdir -p "$root/prometheus" "$root/usr/share/prometheus"
    chown 65534:65534 "$root/prometheus"
    finish_root "$root"
    import_root "$root" "prom/prometheus:v2.42.0" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'USER nobody' \
        --change 'WORKDIR /prometheus' \
        --change 'VOLUME /prometheus' \
        --change 'EXPOSE 9090' \
        --change 'ENTRYPOINT ["/bin/prometheus"]' \
        --change 'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]' \
        --change 'LABEL org.opencontainers.image.description=sluice-standin'
}

# --- haproxy:2.6 -----------------------------------------------------------------------------
build_haproxy() {
    local root
    new_root
    chroot_apt "$root" haproxy
    local v
    v="$(chroot "$root" haproxy -v | sed -n 's/^HAProxy version \([0-9]*\.[0-9]*\).*/\1/p')"
    [ "$v" = 2.6 ] || die "bookworm's haproxy is $v, not 2.6"
    mkdir -p "$root/usr/local/etc/haproxy" "$root/var/lib/haproxy"
    # The official image ships no config: the user's goes to /usr/local/etc/haproxy/haproxy.cfg.
    rm -f "$root/etc/haproxy/haproxy.cfg"
    chroot "$root" chown haproxy:haproxy /var/lib/haproxy
    cat >"$root/usr/local/bin/docker-entrypoint.sh" <<'SH'
#!/bin/sh
# Like the official image's entrypoint: options alone run haproxy, and haproxy runs in the
# foreground in master-worker mode (-W -db), so SIGUSR2 reloads and logs go to stdout.
set -e
if [ "${1#-}" != "$1" ]; then
    set -- haproxy "$@"
fi
if [ "$1" = haproxy ]; then
    shift
    set -- haproxy -W -db "$@"
fi
exec "$@"
SH
    chmod +x "$root/usr/local/bin/docker-entrypoint.sh"
    finish_root "$root"
    import_root "$root" "haproxy:2.6" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'USER haproxy' \
        --change 'WORKDIR /var/lib/haproxy' \
        --change 'ENTRYPOINT ["docker-entrypoint.sh"]' \
        --change 'CMD ["haproxy", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]' \
        --change 'LABEL org.opencontainers.image.description=sluice-standin'
}

[ -f "$BASE_TAR" ] || build_base
for image in "${missing[@]}"; do
    t0=$SECONDS
    case "$image" in
        redis:7) build_redis ;;
        python:3.11-slim) build_python ;;
        prom/prometheus:v2.42.0) build_prometheus ;;
        haproxy:2.6) build_haproxy ;;
        *) die "no stand-in recipe for $image (known: ${ALL_IMAGES[*]})" ;;
    esac
    size="$(docker image inspect --format '{{.Size}}' "$image")"
    log "built stand-in $image: $((size / 1000000)) MB in $((SECONDS - t0)) s"
done
