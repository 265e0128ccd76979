#!/usr/bin/env bash
# A bfloat16 decode step of this tree against the same step at another commit, in one process:
# REV's kernels (engine_service/model/kernels/*.c) are built into one object whose symbols carry a
# `before_` prefix, linked beside this tree's, and scripts/bench_stack.c (-DSTACK_AB) alternates
# the two step by step, the pairs tagged by where the VM's two threads sat.
#
#   scripts/bench_stack_ab.sh REV [context] [rounds] [rows]    e.g. scripts/bench_stack_ab.sh HEAD~1 300 8
#
# rows (default 1): a draft chunk of that many rows, as bench_stack.c takes it.
#
# Needs gcc, binutils (ld, objcopy, nm), AVX512-BF16. docs/performance.md, fourteenth round.
set -euo pipefail
rev=${1:?usage: scripts/bench_stack_ab.sh REV [context] [rounds] [rows]}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
kernels=engine_service/model/kernels
mkdir -p "$work/before"
for path in $(git -C "$root" ls-tree --name-only "$rev" "$kernels/"); do
  case "$path" in *.c|*.h) git -C "$root" show "$rev:$path" > "$work/before/$(basename "$path")" ;; esac
done
flags=(-O3 -march=native -fopenmp -fno-math-errno)
objects=()
for name in decode_stack packed_gemv paged_decode_attention q4_gemv; do
  gcc "${flags[@]}" -c "$work/before/$name.c" -o "$work/before/$name.o"
  objects+=("$work/before/$name.o")
done
ld -r "${objects[@]}" -o "$work/before.o"
# every symbol prefixed, then the ones it takes from libc, libm and libgomp given back their names
nm "$work/before.o" | awk '$1 == "U" {print "before_" $2 " " $2}' > "$work/undefined"
objcopy --prefix-symbols=before_ "$work/before.o" "$work/prefixed.o"
objcopy --redefine-syms="$work/undefined" "$work/prefixed.o" "$work/before_final.o"
gcc "${flags[@]}" -DSTACK_AB "$root/scripts/bench_stack.c" \
  "$root/$kernels/"{decode_stack,packed_gemv,paged_decode_attention,q4_gemv}.c "$work/before_final.o" -lm \
  -o "$work/bench_stack_ab"
OMP_NUM_THREADS=2 OMP_PROC_BIND=true "$work/bench_stack_ab" "${2:-300}" "${3:-8}" "${4:-1}"
