#!/usr/bin/env bash
# The attention kernel of this tree against the same kernel at another commit, alone, in one
# process: REV's engine_service/model/kernels/paged_decode_attention.c is built into one object whose
# symbols carry a `before_` prefix, linked beside this tree's, and scripts/bench_attention_ab.c
# alternates the two, pass by pass, with the caches flushed before each.
#
#   scripts/bench_attention_ab.sh REV [batch] [context] [rounds]    e.g. scripts/bench_attention_ab.sh HEAD~1 16 300
#
# Needs gcc, binutils (objcopy, nm), AVX512. docs/performance.md, "attention's K/V three blocks ahead".
set -euo pipefail
rev=${1:?usage: scripts/bench_attention_ab.sh REV [batch] [context] [rounds]}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
kernels=engine_service/model/kernels
for path in $(git -C "$root" ls-tree --name-only "$rev" "$kernels/"); do
  case "$path" in *.c|*.h) git -C "$root" show "$rev:$path" > "$work/$(basename "$path")" ;; esac
done
flags=(-O3 -march=native -fopenmp -fno-math-errno)
gcc "${flags[@]}" -c "$work/paged_decode_attention.c" -o "$work/before.o"
# every symbol prefixed, then the ones it takes from libc, libm and libgomp given back their names
nm "$work/before.o" | awk '$1 == "U" {print "before_" $2 " " $2}' > "$work/undefined"
objcopy --prefix-symbols=before_ "$work/before.o" "$work/prefixed.o"
objcopy --redefine-syms="$work/undefined" "$work/prefixed.o" "$work/before_final.o"
gcc "${flags[@]}" "$root/scripts/bench_attention_ab.c" "$root/$kernels/paged_decode_attention.c" \
  "$work/before_final.o" -lm -o "$work/bench_attention_ab"
OMP_NUM_THREADS=2 OMP_PROC_BIND=true "$work/bench_attention_ab" "${2:-1}" "${3:-300}" "${4:-24}"
