"""The floor every layer stands on; it imports nothing else of nvoffload.

- :mod:`~nvoffload.core.future`: the one future type and the wait limit (``NVOFFLOAD_WAIT_LIMIT_S``);
  :mod:`~nvoffload.core.deferred`: a part of a future known only once started.
- :mod:`~nvoffload.core.extents`: free-space lists of aligned byte ranges (swap files, the host slab).
- :mod:`~nvoffload.core.buffers`: aligned host buffers and byte views (O_DIRECT's 4 KiB).
- :mod:`~nvoffload.core.workers`: the daemon worker threads that stop at interpreter exit.
- :mod:`~nvoffload.core.atomic`: files and directories replaced whole or not at all, fsynced.
- :mod:`~nvoffload.core.native`: the compiled core's modules, or one line saying it is not built and how to build it.
"""
