"""Swarmtrain's wire contract: protobuf messages, the stage service, tensor codec and stream framing.

Imports nothing else of the project. Regenerate the `_pb2` modules with `scripts/gen_protos.sh`.
"""
