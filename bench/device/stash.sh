#!/usr/bin/env bash
# Copy carried wheel parts into /root/keep/parts on the GPU machine, where they outlast the call's working tree
# (not the machine: a fresh machine starts bare). Idempotent: a part already there with the same size is skipped.
#   bash bench/device/stash.sh .carry/vllm/00            # a folder (its files) or single files
set -euo pipefail
keep=/root/keep/parts
mkdir -p "$keep"
[ $# -gt 0 ] || { echo "usage: stash.sh PART_OR_FOLDER..." >&2; exit 2; }
for arg in "$@"; do
  if [ -d "$arg" ]; then files=("$arg"/*); else files=("$arg"); fi
  for f in "${files[@]}"; do
    [ -f "$f" ] || { echo "stash: no such file: $f" >&2; exit 1; }
    name=$(basename "$f")
    if [ -f "$keep/$name" ] && [ "$(stat -c %s "$keep/$name")" = "$(stat -c %s "$f")" ]; then
      echo "kept    $(stat -c %s "$f") $name"
    else
      cp "$f" "$keep/$name.tmp" && mv "$keep/$name.tmp" "$keep/$name"
      echo "stashed $(stat -c %s "$f") $name"
    fi
  done
done
echo "in $keep: $(ls "$keep" | wc -l) files, $(du -sm "$keep" | cut -f1) MiB"
