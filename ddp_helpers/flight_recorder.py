"""torch's flight recorder, in the words the course uses: how it names dtypes and all-reduces. The hang
report reads it for what each rank waits in; lessons 2-6 read it as evidence of what a run sent.
"""

from __future__ import annotations

# The flight recorder names dtypes as c10 does ("Float"); the report uses torch's names, as the p2p log does.
TORCH_DTYPE_NAMES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
           "short": "int16", "char": "int8", "byte": "uint8", "bool": "bool", "bfloat16": "bfloat16"}


# How the flight recorder names an all-reduce (gloo, nccl, and a coalesced one).
ALL_REDUCE_OPS = ("allreduce", "all_reduce", "allreduce_coalesced")


def torch_dtype_name(flight_recorder_dtype: str) -> str:
    """torch's name ("float32") for a dtype as the flight recorder names it ("Float", or "float")."""
    return TORCH_DTYPE_NAMES.get(flight_recorder_dtype.lower(), flight_recorder_dtype.lower())
