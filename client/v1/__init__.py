"""The kvd.v1 wire contract, generated from proto/kvd/v1 by ``python tools/gen_proto.py``.

Do not edit these files by hand: a test regenerates them and fails on any difference.
``schema`` (enums and plain-data records) imports neither grpc nor protobuf; the ``*_pb2``
modules import protobuf, the ``*_pb2_grpc`` modules grpc. This package imports none of them.
"""
