"""Leave torch.distributed at the end of a script without the exit-time abort of gloo.

gloo's worker thread drops its hold on a finished collective just after the caller's wait returns.
When that releases a tensor Python still tracks, the thread needs the GIL; if the interpreter has
begun shutting down by then, Python ends the thread inside a C++ destructor and the process aborts
("terminate called without an active exception") after all of its work is done: 8 runs in 60 of
a two-process CPU script, none in 60 with a short pause after the last barrier, which lets the
worker finish first.
"""

from __future__ import annotations

import time

import torch.distributed as dist

SETTLE_SECONDS = 0.2


def leave_process_group() -> None:
    """Every rank past its last collective, the gloo workers settled, then the groups destroyed."""
    if not dist.is_initialized():
        return
    dist.barrier()
    time.sleep(SETTLE_SECONDS)  # releases the GIL: the workers drop their last collectives now
    dist.destroy_process_group()
