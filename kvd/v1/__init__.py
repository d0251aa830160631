"""Generated protobuf / gRPC code for the kvd.v1 wire contract.

Do not edit the ``*_pb2*.py`` files: run ``python tools/gen_proto.py`` after changing ``proto/``.
"""
