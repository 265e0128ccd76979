#!/bin/sh
# Make a Redis Cluster of the nodes named as host:port arguments, once. Compose's `cluster` profile
# (service redis-cluster-init) and deploy/k8s/cluster's Job run it:
#   1. wait until every node answers PING;
#   2. when the first node has no slot assigned, `redis-cli --cluster create` over all of them with
#      REDIS_CLUSTER_REPLICAS replicas per master (default 0); a cluster already made is left as it
#      is, so running this again (a second `up`, a retried Job) is harmless;
#   3. wait until every node says cluster_state:ok, so what starts after this finds it whole.
# REDIS_PASSWORD, when set, authenticates (through REDISCLI_AUTH, never on a command line).
# REDIS_CLUSTER_WAIT_S (default 180) bounds the whole wait; past it the job fails.
set -eu

[ "$#" -ge 3 ] || { echo "usage: $0 host:port host:port host:port [host:port ...]" >&2; exit 2; }
if [ -n "${REDIS_PASSWORD:-}" ]; then export REDISCLI_AUTH="$REDIS_PASSWORD"; fi
replicas="${REDIS_CLUSTER_REPLICAS:-0}"
deadline=$(( $(date +%s) + ${REDIS_CLUSTER_WAIT_S:-180} ))

cli() { node="$1"; shift; redis-cli -h "${node%:*}" -p "${node##*:}" "$@" 2>/dev/null | tr -d '\r'; }
info_field() { cli "$1" cluster info | sed -n "s/^$2://p"; }
answers() { [ "$(cli "$1" ping)" = PONG ]; }
is_ok() { [ "$(info_field "$1" cluster_state)" = ok ]; }
wait_for() {  # wait_for CHECK NODE
    until "$1" "$2"; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            echo "redis-cluster-init: $2 did not pass '$1' in time" >&2
            cli "$2" cluster info >&2 || true
            exit 1
        fi
        sleep 1
    done
}

for node in "$@"; do wait_for answers "$node"; done
assigned="$(info_field "$1" cluster_slots_assigned)"
if [ "${assigned:-0}" = 0 ]; then
    echo "redis-cluster-init: creating a cluster of $# nodes, $replicas replica(s) per master"
    redis-cli --cluster create "$@" --cluster-replicas "$replicas" --cluster-yes
else
    echo "redis-cluster-init: $1 already serves $assigned slots; the cluster exists"
fi
for node in "$@"; do wait_for is_ok "$node"; done
echo "redis-cluster-init: cluster_state:ok on all $# nodes"
cli "$1" cluster nodes
