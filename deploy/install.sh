#!/usr/bin/env bash
# Install dspark-serve and its generated stubs into the current Python environment; the Dockerfiles run this after
# installing their pinned torch build, and tests/test_deploy.py runs it in a clean venv (torch then comes in as a
# dependency).   usage: deploy/install.sh cpu|cuda [SRC_DIR]
set -euo pipefail
flavor=${1:?usage: install.sh cpu|cuda [SRC_DIR]}
src=${2:-$(cd "$(dirname "$0")/.." && pwd)}
py=${PYTHON:-python3}
case "$flavor" in
  cpu)  extras=serve ;;
  cuda) extras=serve,triton ;;
  *) echo "install.sh: flavor must be cpu or cuda, got $flavor" >&2; exit 2 ;;
esac
"$py" -m pip install --no-cache-dir "$src[$extras]"
"$py" -c "import dspark_serve.protos.dspark.v1.dspark_pb2_grpc, dspark_serve.cluster.serve_app, dspark_serve.engine.llm"
command -v dspark-serve >/dev/null || "$py" -m dspark_serve.cluster.commands --help >/dev/null
echo "dspark-serve installed ($flavor)"
