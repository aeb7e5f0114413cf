#!/usr/bin/env bash
# Regenerates the Python code beside the .proto files. Needs the `tools` extra
# (grpcio-tools==1.84.0, so the code runs on grpcio >= 1.84.0).
# Usage: bash protos/generate.sh [OUT_DIR]   (default: protos/, in place)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
python -m grpc_tools.protoc -I"$here" --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$here"/loraserve/v1/*.proto
