"""The energy a GPU draws over a span of work, from NVML's energy counter (Volta and newer).

NVML (``libnvidia-ml.so.1``, installed with the NVIDIA driver) keeps each GPU's total energy in millijoules
since the driver loaded; two readings around a span give the energy it drew. The counter is the whole GPU's:
other work on the same GPU during the span counts too. Read through ``ctypes``, so no Python package is needed.
"""

from __future__ import annotations

import ctypes

import torch


class EnergyCounter:
    """``joules()``: the GPU's energy counter, in joules. ``open`` gives one, or None where NVML or the counter is
    not available (no NVIDIA driver, a GPU older than Volta, a GPU another vendor's)."""

    def __init__(self, lib, handle):
        self._lib, self._handle = lib, handle

    @classmethod
    def open(cls, device: torch.device) -> "EnergyCounter | None":
        if device.type != "cuda" or torch.version.hip is not None:
            return None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return None
            handle = ctypes.c_void_p()
            # by UUID: CUDA_VISIBLE_DEVICES renumbers the devices torch sees, and NVML numbers them all
            uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}".encode()
            if lib.nvmlDeviceGetHandleByUUID(ctypes.c_char_p(uuid), ctypes.byref(handle)) != 0:
                return None
            counter = cls(lib, handle)
            counter.joules()
            return counter
        except (OSError, AttributeError, RuntimeError):
            return None

    def joules(self) -> float:
        mj = ctypes.c_ulonglong()
        if self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(mj)) != 0:
            raise RuntimeError("NVML could not read the GPU's energy counter")
        return mj.value / 1000.0
