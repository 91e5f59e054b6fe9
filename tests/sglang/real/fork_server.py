"""The target's fork server (forks.py) as it starts, before it forks any
process: it dies with the main process that started it, and imports once
what every process of the target imports.

Dying with the main process: the processes forked from here die with this
one (each sets its parent-death signal: SGLang's schedulers through
kill_itself_when_parent_died, the detokenizer and the decodes themselves),
as they died with the main process when it was their parent; a stopped
one too (a SIGSTOPped decode or scheduler would otherwise keep this server,
and itself, alive past the test: multiprocessing's own end for a fork
server is every process it forked gone).

The imports: torch, transformers and SGLang's server modules (what
ServerArgs, the KV managers' base classes and the scheduler IPC pull in),
about 15 s of CPU each time. Not the transfer library: NIXL's build is
chosen per process before SGLang's nixl module is imported
(common.select_nixl), and Mooncake's engine starts threads when it loads,
which a fork would not carry over; each process imports its backend's
module after the fork (~0.2 s). Nothing imported here starts a thread a
fork would lose (numpy's OpenBLAS pool is remade in a forked child).
"""

import ctypes
import gc
import importlib
import os
import signal

# What every process of the target imports but its transfer backend's
# module: what ServerArgs, the KV managers' base classes, the scheduler IPC
# and its output, SGLang's process set-up and the TP group pull in.
MODULES = (
    "numpy",
    "setproctitle",
    "torch.distributed",
    "zmq",
    "sglang.srt.disaggregation.base.conn",
    "sglang.srt.disaggregation.common.conn",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.managers.io_struct",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.managers.scheduler_components.output_sender",
    "sglang.srt.runtime_context",
    "sglang.srt.server_args",
    "sglang.srt.utils.common",
)

ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
# The environment the main process has, for every process forked from
# here: without the directory forks.py put first on PYTHONPATH to import
# this module.
_path = os.environ["PYTHONPATH"].split(os.pathsep)[1:]
if _path:
    os.environ["PYTHONPATH"] = os.pathsep.join(_path)
else:
    del os.environ["PYTHONPATH"]
for name in MODULES:
    importlib.import_module(name)
# What was imported stays as it is in every process forked from here: the
# collector leaves it alone rather than touch (and so copy) its pages in
# each of them.
gc.freeze()
