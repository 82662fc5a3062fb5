"""An arm's sustained time per call, with the board's power and SM clock, over a burst of replays.

An H200 running a GEMM back to back sits at its power limit, and then the clock, not
the kernel alone, sets the time: two kernels that do the same work at different energy
run at different clocks.  ``triton.testing.do_bench`` flushes L2 before every replay, so
the GPU idles at memory speed between calls and starts each one with power in hand; a
burst of back-to-back replays is the regime of a training step, where nothing pauses.
The power and clock are read through NVML (``pynvml``, from the ``nvidia-ml-py``
package), which changes no setting.  The driver's cumulative energy counter is not used:
over bursts of a few hundred ms its steps gave energies off by up to 20 % from power
times time on an H200.
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
            raise RuntimeError("power readings need pynvml (pip install nvidia-ml-py)") from exc
        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)

    def burst(self, replay: Callable[[], None], calls: int,
              sample_s: float = 0.005) -> dict[str, float]:
        """Enqueue ``calls`` replays of ``replay`` (one call each) back to back, and while the
        GPU drains them sample the power and the SM clock; returns ``ms_per_call`` (CUDA
        events around the burst), ``watts`` and ``sm_mhz`` (medians of the samples)."""
        nvml, handle = self._nvml, self._handle
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            replay()
        done.record()
        clocks, watts = [], []
        while not done.query():
            clocks.append(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
            watts.append(nvml.nvmlDeviceGetPowerUsage(handle) / 1e3)
            time.sleep(sample_s)
        return dict(ms_per_call=start.elapsed_time(done) / calls,
                    watts=statistics.median(watts) if watts else float("nan"),
                    sm_mhz=statistics.median(clocks) if clocks else float("nan"))
