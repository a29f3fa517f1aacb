"""Neural-network layers on index grids: sparse 3-D convolution in exact FP32 (``sparse_conv3d``,
``SparseConv3d``). Features are plain ``[num_voxels, C]`` tensors in the grid's voxel order."""

from .conv import SparseConv3d, sparse_conv3d

__all__ = ["SparseConv3d", "sparse_conv3d"]
