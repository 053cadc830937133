#!/usr/bin/env bash
# A/B (or bisect) of several commits in one GPU session: snapshot each commit's tree here, carry
# the folder to the GPU machine, run the same benchmark on every snapshot there, alternating.
#
#   bash benchmarks/ab_snapshots.sh SNAPDIR C1 C2 ...      # here: SNAPDIR/<commit>/ per commit
#   cd SNAPDIR && bash run.sh ROUNDS CMD...                 # there: CMD in every snapshot, ROUNDS
#                                                           # times, order reversed every round
# e.g. `bash run.sh 2 python3 -m benchmarks.decode --no-hf --adapters 8 32 --batches 64`.
# `bash run.sh --only C CMD...`: CMD once in snapshot C alone (its tests, say), with the same
# imports as the rounds (a plain `cd C && pytest` would import the editable install's package,
# which is the first snapshot's).
# Each snapshot imports its own code (loraplex.* resolves through a per-snapshot package dir)
# and stamps its tables with its commit (LORAPLEX_COMMIT). Wheels in .whl/ are carried along.
# Output: $OUT/ab_<commit>_<round>.log.
set -euo pipefail
dir=${1:?snapshot dir}; shift
[[ $# -ge 1 ]] || { echo "give at least one commit" >&2; exit 2; }
mkdir -p "$dir"
for c in "$@"; do
  short=$(git rev-parse --short "$c")
  rm -rf "${dir:?}/$short" && mkdir -p "$dir/$short"
  git archive "$short" -- . ':(exclude)docs' | tar -x -C "$dir/$short"  # (docs: figures, ~9 MB)
  echo "$short" > "$dir/$short/COMMIT"
  echo "$short" >> "$dir/ORDER.tmp"
done
mv "$dir/ORDER.tmp" "$dir/ORDER"
if compgen -G ".whl/*.whl" >/dev/null; then mkdir -p "$dir/.whl" && cp .whl/*.whl "$dir/.whl/"; fi
cat > "$dir/run.sh" <<'EOF'
#!/usr/bin/env bash
set -uo pipefail
R=$PWD; OUT=${OUT:-$R/out}; mkdir -p "$OUT"
only=""
if [[ ${1:-} == --only ]]; then only=$2; shift 2; rounds=1; else rounds=${1:?rounds}; shift; fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
mapfile -t order < ORDER
# entry points (resolver plugins) come from one editable install; the code from each snapshot
(cd "${order[0]}" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1) \
  || echo "editable install failed"
for c in "${order[@]}"; do
  mkdir -p "/tmp/pk_$c/loraplex"
  for t in engine resolvers plugins; do ln -sfn "$R/$c/$t" "/tmp/pk_$c/loraplex/$t"; done
done
for ((i = 0; i < rounds; i++)); do
  seq=("${order[@]}"); (( i % 2 )) && seq=($(printf '%s\n' "${order[@]}" | tac))
  [[ -n $only ]] && seq=("$only")
  for c in "${seq[@]}"; do
    echo "== $c round $i"
    (cd "$R/$c" && PYTHONPATH="/tmp/pk_$c:$R/$c:/tmp/site" LORAPLEX_COMMIT=$c OUT="$OUT" "$@") \
      > "$OUT/ab_${c}_$i.log" 2>&1
    if [[ -n $only ]]; then tail -15 "$OUT/ab_${c}_$i.log"; else
      grep -v "\[info\|\[warn" "$OUT/ab_${c}_$i.log" | grep "^|" | tail -4
    fi
  done
done
EOF
echo "snapshots in $dir: $(tr '\n' ' ' < "$dir/ORDER"); carry $dir, then: cd $dir && bash run.sh ROUNDS CMD..."
mb=$(du -sm "$dir" | cut -f1)
if (( mb > 60 )); then
  echo "warning: $dir is $mb MB; a device call carries 64 MiB at most (fewer snapshots, or drop tests/)" >&2
fi
