#!/usr/bin/env bash
# mypy on the packages as they install. mypy cannot follow setuptools' package-dir mapping
# (compress.quantization -> quantization/, ...), so it checks a view of the tree made of links:
# compress/ holding compress/'s own files and the other top folders under their installed names.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
view="$(mktemp -d)"
trap 'rm -rf "$view"' EXIT
mkdir "$view/compress"
for f in "$root"/compress/*; do ln -s "$f" "$view/compress/"; done
for p in quantization pruning distillation export recipes; do ln -s "$root/$p" "$view/compress/$p"; done
cd "$view"
mypy --config-file "$root/pyproject.toml" compress "$@"
