#!/usr/bin/env bash
# Join the stashed wheel parts (stash.sh), check each wheel's sha256 against bench/device/vllm_wheels.txt, and
# install them all with --no-deps into /root/keep/site (never torch: the image's torch 2.11.0+cu130 stays). Then
# `import vllm` under PYTHONPATH=/root/keep/site and a check of vLLM's and TRL's requirements against what that
# path sees. Idempotent: a second run on the same wheels only repeats the checks.
#   bash bench/device/install_vllm.sh [KEEP [MANIFEST]]   # exit 1 if a core wheel is missing or corrupt, or vllm
#                                                         # won't import (KEEP: /root/keep; MANIFEST: vllm_wheels.txt)
#   export PYTHONPATH=/root/keep/site:$PWD                # then, in every later command of the same machine
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
keep=${1:-/root/keep}
manifest=${2:-$here/vllm_wheels.txt}
parts=$keep/parts wheels=$keep/wheels site=$keep/site
mkdir -p "$wheels" "$site"
missing_core=() missing_optional=() bad=() ready=()
while read -r sha size group name; do
  case "$sha" in ''|'#'*) continue ;; esac
  target=$wheels/$name
  if [ ! -f "$target" ]; then
    if [ -f "$parts/$name" ]; then
      ln -f "$parts/$name" "$target" 2>/dev/null || cp "$parts/$name" "$target"
    elif compgen -G "$parts/$name.part-*" >/dev/null; then
      pieces=($(ls "$parts/$name".part-* | sort))
      last=${pieces[-1]##*.part-}
      if [ -f "$parts/$name.part-00" ] && [ $((10#$last + 1)) -eq ${#pieces[@]} ]; then  # no part left out
        cat "${pieces[@]}" > "$target.tmp" && mv "$target.tmp" "$target"
      fi
    fi
  fi
  if [ ! -f "$target" ]; then
    if [ "$group" = core ]; then missing_core+=("$name"); else missing_optional+=("$name"); fi
    continue
  fi
  if [ "$(stat -c %s "$target")" != "$size" ] || [ "$(sha256sum "$target" | cut -d' ' -f1)" != "$sha" ]; then
    bad+=("$name"); rm -f "$target"; continue
  fi
  ready+=("$target")
done < "$manifest"
echo "wheels ready: ${#ready[@]}; missing core: ${#missing_core[@]}; missing optional: ${#missing_optional[@]}; bad: ${#bad[@]}"
[ ${#missing_optional[@]} -eq 0 ] || echo "optional wheels not stashed (fine for dense models on Hopper): ${missing_optional[*]}"
if [ ${#bad[@]} -gt 0 ]; then echo "BAD (size or sha256; removed, stash again): ${bad[*]}"; exit 1; fi
if [ ${#missing_core[@]} -gt 0 ]; then echo "MISSING core wheels (stash their parts first): ${missing_core[*]}"; exit 1; fi
stamp=$(printf '%s\n' "${ready[@]}" | sort | sha256sum | cut -c1-16)
if [ "$(cat "$site/.rlx-installed" 2>/dev/null)" = "$stamp" ]; then
  echo "already installed in $site ($stamp)"
else
  start=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${ready[@]}"
  echo "$stamp" > "$site/.rlx-installed"
  echo "installed ${#ready[@]} wheels into $site in $(( $(date +%s) - start )) s ($(du -sm "$site" | cut -f1) MiB)"
fi
for pkg in torch torchvision torchaudio triton; do
  if [ -e "$site/$pkg" ]; then echo "ERROR: $site/$pkg would shadow the image's $pkg"; exit 1; fi
done
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
python3 - <<'PY'
import importlib.metadata as md
import sys

import torch
from packaging.requirements import Requirement

print(f"python {sys.version.split()[0]}; torch {torch.__version__} from {torch.__file__}; cuda {torch.version.cuda}")
env = {"extra": ""}
unmet = []
for top in ("vllm", "trl", "fastapi", "pydantic", "openai", "datasets", "xgrammar"):
    try:
        dist = md.distribution(top)
    except md.PackageNotFoundError:
        unmet.append(f"{top}: not installed")
        continue
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{top} needs {req}: missing")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{top} needs {req}: have {have}")
print("requirements not met (--no-deps install; most are harmless for rlx's use):" if unmet else "all requirements met")
for line in unmet:
    print("  " + line)
try:
    import vllm
except Exception as e:
    print(f"import vllm: FAILED {type(e).__name__}: {e}")
    sys.exit(1)
print(f"import vllm: OK, version {vllm.__version__} from {vllm.__file__}")
assert torch.__version__.startswith("2.11"), "the image torch 2.11 was replaced"
PY
