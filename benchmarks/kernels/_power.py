"""The board's energy per call, power and SM clock over a burst of graph replays (NVML).

An H200 running a GEMM back to back sits at its power limit, and then the clock, not
the kernel, sets the time: two kernels that do the same work at different energy run
at different clocks.  This is the measurement that tells those apart from a slower
instruction stream; it reads the driver's counters through NVML (``pynvml``, from the
``nvidia-ml-py`` package) and changes no setting.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class BoardMeter:
    """NVML's handle of the current CUDA device (``CUDA_VISIBLE_DEVICES`` mapped by its
    bus id); raises ``RuntimeError`` when NVML cannot be had."""

    def __init__(self, device: torch.device | None = None):
        try:
            import pynvml
        except ImportError as exc:
            raise RuntimeError("energy needs pynvml (pip install nvidia-ml-py)") from exc
        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)

    def burst(self, replay: Callable[[], None], calls: int,
              sample_s: float = 0.005) -> dict[str, float]:
        """Enqueue ``calls`` replays of ``replay`` (one call each), and while the GPU drains
        them sample the SM clock and the power; returns ``mj_per_call`` (the energy
        counter's difference over the burst, divided by ``calls``), ``watts`` and
        ``sm_mhz`` (medians of the samples) and ``ms_per_call`` (host wall time)."""
        nvml, handle = self._nvml, self._handle
        done = torch.cuda.Event()
        torch.cuda.synchronize()
        start_mj = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        start = time.perf_counter()
        for _ in range(calls):
            replay()
        done.record()
        clocks, watts = [], []
        while not done.query():
            clocks.append(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
            watts.append(nvml.nvmlDeviceGetPowerUsage(handle) / 1e3)
            time.sleep(sample_s)
        elapsed = time.perf_counter() - start
        energy = nvml.nvmlDeviceGetTotalEnergyConsumption(handle) - start_mj
        return dict(mj_per_call=energy / calls, ms_per_call=elapsed * 1e3 / calls,
                    watts=statistics.median(watts) if watts else float("nan"),
                    sm_mhz=statistics.median(clocks) if clocks else float("nan"))
