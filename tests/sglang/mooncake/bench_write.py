#!/usr/bin/env python3
"""Mooncake WRITEs as SGLang's prefill makes them, as fast as they go, for the
cost of watching them (agent/benches/mooncake.rs).

Two processes, each with SGLang 0.5.23's own MooncakeTransferEngine
(sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py,
over the real engine of mooncake-transfer-engine-non-cuda 0.3.13.post1, TCP
on loopback, P2PHANDSHAKE metadata), made as SGLang's model-runner set-up
makes it (init_mooncake_transfer_engine, MOONCAKE_PROTOCOL=tcp):
- this one, the writer (a prefill's transfer worker): registers its source
  buffer and, per transfer, calls the wrapper's batch_transfer_sync (the
  binding's batch_transfer_sync_write), exactly as SGLang's
  MooncakeKVManager._transfer_data does for one chunk and destination:
  --requests runs of --size bytes, one batch;
- a target (`--serve`, a decode's engine): registers its destination buffer
  and waits; nothing of it runs per transfer but the engine's own threads.
The writer also imports pyzmq (so libzmq is mapped as in an SGLang prefill:
the `sglang-mooncake` profile attaches there too) but sends nothing over it.

Not SGLang's KV manager, sender or bootstrap: those are what
tests/sglang/mooncake/prefill.py runs for the e2e tests; this measures the
engine calls the profile probes, at the rate they can be made.

Protocol (JSON lines on stdout; fd 1 goes to stderr): {"event":"ready",
"pid":P,"target_pid":T,"session":S}, after one warm-up transfer (which opens
the target's segment); then it waits for "go" on stdin, makes --count
transfers and prints {"event":"done","transfers":N,"transfers_per_s":R,
"gb_per_s":G,"bytes":B}, the first and last bytes written checked at the
target. A transfer that fails is an error (exit 1).
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "real"))
from common import claim_stdout, emit  # noqa: E402


def make_engine():
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )

    return init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0)


def serve(a):
    """The target: a registered destination buffer, until stdin closes;
    `check OFFSET LEN` prints the bytes there (hex)."""
    import ctypes

    import numpy as np

    engine = make_engine()
    buf = np.zeros(a.size * a.requests, dtype=np.uint8)
    engine.register(buf.ctypes.data, buf.nbytes)
    emit("ready", pid=os.getpid(), session=engine.get_session_id(), addr=buf.ctypes.data)
    for line in sys.stdin:
        parts = line.split()
        if parts and parts[0] == "check":
            offset, length = int(parts[1]), int(parts[2])
            emit("bytes", hex=ctypes.string_at(buf.ctypes.data + offset, length).hex())
    return 0


def main():
    p = argparse.ArgumentParser(prog="bench_write.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=4096, help="bytes per request (run)")
    p.add_argument("--requests", type=int, default=1, help="requests (runs) per batch")
    p.add_argument("--count", type=int, default=1000, help="batches to transfer after go")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    claim_stdout()  # the engine's glog output goes to stderr
    if a.serve:
        return serve(a)
    import numpy as np
    import zmq  # noqa: F401  (mapped, as in an SGLang prefill)

    target = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", "--size", str(a.size), "--requests", str(a.requests)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    ready = json.loads(target.stdout.readline())
    engine = make_engine()
    src = np.frombuffer(os.urandom(a.size * a.requests), dtype=np.uint8).copy()
    engine.register(src.ctypes.data, src.nbytes)
    srcs = [src.ctypes.data + i * a.size for i in range(a.requests)]
    dsts = [ready["addr"] + i * a.size for i in range(a.requests)]
    lens = [a.size] * a.requests
    session = ready["session"]

    def transfer():
        ret = engine.batch_transfer_sync(session, srcs, dsts, lens)
        if ret != 0:
            raise SystemExit(f"batch_transfer_sync to {session} returned {ret}")

    transfer()  # opens the target's segment
    emit("ready", pid=os.getpid(), target_pid=target.pid, session=session)
    if sys.stdin.readline().strip() != "go":
        return 2
    start = time.perf_counter()
    for _ in range(a.count):
        transfer()
    elapsed = time.perf_counter() - start
    total = src.nbytes
    for offset, length in ((0, min(16, total)), (total - min(16, total), min(16, total))):
        target.stdin.write(f"check {offset} {length}\n")
        target.stdin.flush()
        got = json.loads(target.stdout.readline())["hex"]
        if got != src[offset:offset + length].tobytes().hex():
            raise SystemExit(f"the target holds {got} at {offset}, not what was written")
    target.stdin.close()
    target.wait()
    emit("done", transfers=a.count, transfers_per_s=a.count / elapsed,
         gb_per_s=a.count * total / elapsed / 1e9, bytes=total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
