#!/usr/bin/env bash
# A/B of environment switches in one build: the same command under each setting, alternating
# the order every round, each run's output labelled with its setting.
#
#   bash benchmarks/ab_env.sh ROUNDS SETTING1 SETTING2 ... -- CMD...
#
# A setting is one or more VAR=value words separated by commas ("-" for none), e.g.
#   bash benchmarks/ab_env.sh 2 LORAPLEX_B_LAYOUT=rank-major LORAPLEX_B_LAYOUT=column-major \
#     -- python3 -m benchmarks.mixed_rank --cases 3
# Table rows (lines starting with "|") are printed as "setting: row"; the full output of each
# run goes to $OUT/env_<n>_<round>.log (n: the setting's position).
set -uo pipefail
rounds=${1:?rounds}; shift
settings=()
while [[ $# -gt 0 && $1 != -- ]]; do settings+=("$1"); shift; done
[[ ${1:-} == -- ]] || { echo "usage: ab_env.sh ROUNDS SETTING... -- CMD..." >&2; exit 2; }
shift
OUT=${OUT:-out}; mkdir -p "$OUT"
n=${#settings[@]}
for ((i = 0; i < rounds; i++)); do
  for ((j = 0; j < n; j++)); do
    (( i % 2 )) && k=$((n - 1 - j)) || k=$j
    s=${settings[$k]}
    vars=()
    [[ $s != - ]] && IFS=, read -ra vars <<< "$s"
    env "${vars[@]}" "$@" > "$OUT/env_${k}_$i.log" 2>&1
    rc=$?
    grep "^|" "$OUT/env_${k}_$i.log" | grep -v "^|--\|^| *case\|^| *commit" | sed "s/^/$s (round $i): /"
    (( rc )) && echo "$s (round $i): exit $rc, see $OUT/env_${k}_$i.log"
  done
done
