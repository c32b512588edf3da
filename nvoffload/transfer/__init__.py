"""One transfer engine for every byte that moves between NVMe, host memory and the compute device.

- :class:`TransferEngine` -- host<->device copies on per-direction copy streams ordered by events,
  NVMe<->device (GPUDirect Storage, or through the slab), chains of transfers.
- :class:`HostSlab` -- the host budget as one page-locked allocation, carved into aligned buffers.
- :class:`ReadAhead`, :class:`WriteBehind` -- reads ahead of use and writes behind it, within byte budgets;
  :func:`relay` -- items moved from reads to writes through a ring of buffers (a checkpoint's copies).
- :class:`FreeBehind` -- memory a transfer still uses, freed once that transfer ended (never by a host wait).
- :class:`Future` -- the one future type (``done()``, ``result(timeout)``).
"""

from nvoffload.core.future import WAIT_LIMIT_S, Future
from nvoffload.transfer.engine import TransferEngine
from nvoffload.transfer.frees import FreeBehind
from nvoffload.transfer.queues import ReadAhead, WriteBehind, relay
from nvoffload.transfer.slab import HostSlab

__all__ = ["FreeBehind", "Future", "HostSlab", "ReadAhead", "TransferEngine", "WAIT_LIMIT_S", "WriteBehind", "relay"]
