#!/usr/bin/env bash
# The carry route to a GPU machine with no network (docs/gpu.md, "The carry route"): what it lacks,
# as Python 3.12 / x86-64 wheels unpacked into one site folder, xz-packed and split into parts that
# each fit one call's transfer (64 MiB with the working tree); joined and unpacked there.
#
#   deploy/gpu_carry.sh prepare [--max-kib N]    # here, with the package registry: .gpu_carry/partNN/
#                                                # (parts of 56 MiB by default)
#   deploy/gpu_carry.sh status                   # there, after each carrying call: the parts present
#   deploy/gpu_carry.sh install [SITE]           # there, on the last call: verify, unpack into SITE
#                                                # (default .gpu_carry/site, kept while the machine
#                                                # is warm); then: export PYTHONPATH=$PWD:SITE
#   deploy/gpu_carry.sh --dry-run                # here: prepare a small list, then status and install
#                                                # from the parts into a scratch folder (proves the route)
# The package list is deploy/gpu_carry.txt (name==version, one per line; `#` comments).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DIR=.gpu_carry  # ignored (.gitignore): each part folder is named in one call's `carry`
LIST=${GPU_CARRY_LIST:-deploy/gpu_carry.txt}
PY=${PYTHON:-python3}
MAX_KIB=$((56 * 1024))
# Top-level folders some wheels ship beside their package (TransferQueue's tests/, recipe/, ...): on
# the path they would shadow the repository's own `tests` package.
STRAY=(tests recipe tutorial scripts)

download() {  # $1: folder; the list's wheels for CPython 3.12 on x86-64 Linux, no dependencies resolved
  local plats=() n
  for n in 28 27 17 31 34 35 24; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
  plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
  grep -Ev '^\s*(#|$)' "$LIST" | sed 's/\s*#.*//' | while read -r req; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none "${plats[@]}" -d "$1" "$req" 2> /dev/null ||
      "$PY" -m pip wheel -q --no-deps -w "$1" "$req" ||  # an sdist only (antlr4): a pure-Python wheel built here
      { echo "gpu_carry: no Python 3.12 x86-64 wheel for $req" >&2; exit 1; }
  done
}

prepare() {
  rm -rf "$DIR" && mkdir -p "$DIR/wheels" "$DIR/site"
  download "$DIR/wheels"
  for w in "$DIR"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$DIR/site"; done  # a wheel is a zip: unpacked as pip would
  rm -rf "$DIR"/site/ray/jars "$DIR"/site/ray/rllib  # ray's Java and RLlib: unused, 47 MB
  rm -rf "$DIR"/site/xgrammar/include "$DIR"/site/xgrammar/lib/*.a  # a static library Python never loads: 30 MB
  rm -rf "${STRAY[@]/#/$DIR/site/}"
  find "$DIR/site" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$DIR/site" -cf - . | xz -T0 -6 > "$DIR/site.tar.xz"
  split -b "${MAX_KIB}k" -d -a 2 "$DIR/site.tar.xz" "$DIR/chunk"
  local i=0 sum parts
  sum=$(sha256sum "$DIR/site.tar.xz" | cut -d' ' -f1)
  parts=$(ls "$DIR"/chunk* | wc -l)
  for c in "$DIR"/chunk*; do
    i=$((i + 1))
    mkdir -p "$DIR/part$(printf %02d $i)"
    mv "$c" "$DIR/part$(printf %02d $i)/chunk"
    echo "$sum $parts" > "$DIR/part$(printf %02d $i)/manifest"  # every part knows the whole
  done
  rm -rf "$DIR/wheels" "$DIR/site" "$DIR/site.tar.xz"
  echo "gpu_carry: $(grep -cEv '^\s*(#|$)' "$LIST") packages, $parts part(s) of at most $MAX_KIB KiB:"
  du -sh "$DIR"/part* | sed 's/^/  /'
  echo "carry each in a call of its own, back to back (the machine keeps them while warm), e.g."
  echo "  run(command='deploy/gpu_carry.sh status', carry=['$DIR/part01'])  ... then the last part with"
  echo "  run(command='deploy/gpu_carry.sh install && export PYTHONPATH=\$PWD:\$PWD/$DIR/site && ...', carry=['$DIR/partNN'])"
}

status() {
  local have=0 want="?"
  for m in "$DIR"/part*/manifest; do
    [[ -f $m ]] || continue
    have=$((have + 1))
    want=$(cut -d' ' -f2 "$m")
  done
  echo "gpu_carry: $have of $want part(s) here: $(ls -d "$DIR"/part* 2> /dev/null | xargs -n1 basename 2> /dev/null | tr '\n' ' ')"
  [[ $want != "?" && $have == "$want" ]]
}

install() {
  local site=${1:-$ROOT/$DIR/site} sum
  status || { echo "gpu_carry: parts are missing (a call between carried ones let the machine go back?)" >&2; exit 1; }
  sum=$(cut -d' ' -f1 "$(ls "$DIR"/part*/manifest | head -1)")
  mkdir -p "$site"
  cat "$DIR"/part*/chunk > /tmp/gpu_carry.tar.xz
  [[ $(sha256sum /tmp/gpu_carry.tar.xz | cut -d' ' -f1) == "$sum" ]] ||
    { echo "gpu_carry: the joined parts do not match their checksum" >&2; exit 1; }
  xz -T0 -dc /tmp/gpu_carry.tar.xz | tar -C "$site" -xf -
  rm -rf "${STRAY[@]/#/$site/}"
  rm -f /tmp/gpu_carry.tar.xz
  echo "gpu_carry: unpacked into $site ($(du -sh "$site" | cut -f1)); export PYTHONPATH=$ROOT:$site"
  # Subprocesses that set their own PYTHONPATH (some tests do) find it too: a .pth in the interpreter's
  # site-packages puts it first on every sys.path, where that folder is writable (else PYTHONPATH only)
  local purelib
  purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [[ -w $purelib && ${GPU_CARRY_PTH:-1} == 1 ]]; then
    echo "import sys; sys.path.insert(0, '$site')" > "$purelib/sc_grpo_gpu_carry.pth"
    echo "gpu_carry: $purelib/sc_grpo_gpu_carry.pth puts it first for every process of $PY"
  fi
}

case "${1:-}" in
  prepare)
    [[ "${2:-}" == "--max-kib" ]] && MAX_KIB=$3
    prepare
    ;;
  status) status ;;
  install) install "${2:-}" ;;
  --dry-run)  # the route end to end on two small pure-Python wheels, in parts of 24 KiB
    printf 'six==1.17.0\nidna==3.10\n' > /tmp/gpu_carry_dry.txt
    GPU_CARRY_LIST=/tmp/gpu_carry_dry.txt "$0" prepare --max-kib 24
    "$0" status
    rm -rf /tmp/gpu_carry_dry_site
    GPU_CARRY_PTH=0 "$0" install /tmp/gpu_carry_dry_site  # (no .pth here: this machine's Python stays as it is)
    PYTHONPATH=/tmp/gpu_carry_dry_site "$PY" -c "import six, idna; print('gpu_carry dry run: imported six', six.__version__, 'and idna', idna.__version__)"
    rm -rf "$DIR" /tmp/gpu_carry_dry_site /tmp/gpu_carry_dry.txt
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
