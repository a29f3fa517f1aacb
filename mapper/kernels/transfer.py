"""Host-to-device copies that do not make the host wait (the per-frame parameters: poses, intrinsics,
page tables)."""

from __future__ import annotations

import torch


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A (small) host tensor on ``device``. On CUDA through pinned memory, without waiting: a copy from
    pageable memory makes the host wait for the stream (a host sync per frame for a pose); the pinned block
    comes from torch's caching host allocator, which keeps it until the copy has run."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
