"""mapper: GPU-backed real-time 3D mapping on sparse index grids."""

# submodules usable after a plain `import mapper` (mapper.io.write_ply, mapper.render.slice_to_png, ...)
from . import io, mesh, render
from .errors import (
    CapacityExceeded,
    Conflict,
    InvalidArgument,
    InvalidArgumentType,
    MapperError,
    NotFound,
)
from .grid import IndexGrid
from .map import Map

__all__ = [
    "CapacityExceeded",
    "Conflict",
    "IndexGrid",
    "Map",
    "InvalidArgument",
    "InvalidArgumentType",
    "MapperError",
    "NotFound",
    "io",
    "mesh",
    "render",
]
__version__ = "0.1.0"
