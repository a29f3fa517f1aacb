"""mapper: GPU-backed real-time 3D mapping on sparse index grids."""

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
]
__version__ = "0.1.0"
