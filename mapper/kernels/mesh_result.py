"""The result of the marching-cubes op with no triangle, shared by the torch reference (``marching``) and
the Triton kernels (``triton_mesh``) so that neither imports the other."""

from __future__ import annotations

import torch


def empty_result(m: int, device, with_color: bool):
    z = torch.zeros
    return (
        z(m, dtype=torch.int64, device=device),
        z(0, dtype=torch.int64, device=device),
        z((0, 3), dtype=torch.float32, device=device),
        z((0, 3), dtype=torch.float32, device=device),
        z((0, 3), dtype=torch.uint8, device=device) if with_color else None,
        z((0, 3), dtype=torch.int64, device=device),
    )
