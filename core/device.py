"""Host lists onto the model's device without waiting for it.

`torch.tensor(values, device="cuda")` copies from pageable host memory with a blocking copy,
which first waits for every kernel queued on the stream: a hidden host sync. Called for each pass's
metadata and each drafting step's row indices, it kept the host from running ahead of the GPU.
`to_device` copies from pinned memory without blocking (PyTorch's pinned-memory cache keeps the
buffer until the copy is done); on any other device it is `torch.tensor`.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (a list, nested lists of one length) as a tensor on `device`, copied without
    waiting for the device."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
