#!/usr/bin/env bash
# Install a bundle made by workflow/offline/bundle.py on the offline machine:
#   bash workflow/offline/install.sh PARTS_DIR [SITE_DIR]
# joins PARTS_DIR/bundle.tar.part.* and installs the wheels (no index, no dependency
# resolution: the bundle already holds what the target lacks) into SITE_DIR, default the
# interpreter's site-packages. Then `export PYTHONPATH=SITE_DIR` where SITE_DIR was given.
set -euo pipefail
parts=${1:?usage: install.sh PARTS_DIR [SITE_DIR]}
ls "$parts"/bundle.tar.part.* >/dev/null 2>&1 || { echo "install.sh: no bundle.tar.part.* in $parts" >&2; exit 2; }
tmp=$(mktemp -d)
cat "$parts"/bundle.tar.part.* | tar x -C "$tmp"
target=()
[ -n "${2:-}" ] && target=(--target "$2")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "${target[@]}" "$tmp"/wheels/*.whl
echo "install.sh: installed $(ls "$tmp"/wheels | wc -l) wheels${2:+ into $2}"
rm -rf "$tmp"
