#!/bin/sh
# Engine image entrypoint: point `sluice model prepare` at the model source wheel baked into the
# image (when the build had one), so the first start needs no network; then run the command.
set -e
if [ -z "${SLUICE_MODEL_SOURCE:-}" ]; then
    for whl in /opt/sluice/model/*.whl; do
        if [ -f "$whl" ]; then export SLUICE_MODEL_SOURCE="$whl"; fi
    done
fi
exec "$@"
