#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC modules of protocols/ from its .proto files.
# CI runs this and fails if the result differs from what is committed.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. protocols/tensor.proto protocols/stage.proto protocols/expert.proto protocols/relay.proto protocols/averaging.proto
rm -f protocols/tensor_pb2_grpc.py
