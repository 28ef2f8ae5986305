"""Parallelism applied to a plain GPT by separate functions: stage cut, Ulysses SP, FSDP2 over dp x sp."""

from lightning_sppo.parallel.dims import MESH_DIMS, ParallelDims, build_device_mesh
from lightning_sppo.parallel.fsdp import FSDPOptions, activation_dtype, apply_fsdp
from lightning_sppo.parallel.parallelize import parallelize_gpt
from lightning_sppo.parallel.stages import layers_per_stage, split_stage
from lightning_sppo.parallel.ulysses import apply_ulysses

__all__ = [
    "MESH_DIMS",
    "FSDPOptions",
    "ParallelDims",
    "activation_dtype",
    "apply_fsdp",
    "apply_ulysses",
    "build_device_mesh",
    "layers_per_stage",
    "parallelize_gpt",
    "split_stage",
]
