"""The element types kvd ships, by wire value (``kvd.v1.DType``) and by torch name.

The daemon's layout specs and the engine patch name dtypes as torch does (``"bfloat16"``,
``"float8_e4m3fn"``); the wire carries :class:`~kvd_client.v1.schema.DType`. This is the one
table between the two (a test checks it covers every DType). Imports neither grpc nor torch.
"""

from __future__ import annotations

from kvd_client.v1.schema import DType

__all__ = ["DTYPE_NAMES", "DTYPE_OF_NAME", "DType"]

DTYPE_NAMES: dict[DType, str] = {
    DType.FLOAT16: "float16",
    DType.BFLOAT16: "bfloat16",
    DType.FLOAT32: "float32",
    DType.FLOAT8_E4M3: "float8_e4m3fn",
    DType.FLOAT8_E5M2: "float8_e5m2",
    DType.UINT8: "uint8",
}
"""Torch's name of each wire dtype."""

DTYPE_OF_NAME: dict[str, DType] = {name: dtype for dtype, name in DTYPE_NAMES.items()}
"""The wire dtype of each torch name."""
