#!/usr/bin/env python3
"""SGLang's bootstrap messages at full rate, for the cost of watching them.

One process, a NIXL agent created (so libnixl and UCX are mapped, as in an
SGLang prefill, and the `sglang` profile's NIXL probes attach) and a ZMQ
PUSH/PULL pair over ipc. Each round, for a room of its own, it sends and
receives, with pyzmq's copying send_multipart / recv_multipart as SGLang's
bootstrap thread does, the two messages a prefill handles per room and
decode rank (frames as tests/sglang/real/prefill.py's header documents them):
  [b"NixlMsgGuard", room, ip, port, agent, page indices, aux, ranks, ...]
      (the decode's destination, received: the room is enqueued)
  [b"KV_STATUS", room, b"4", rank, b""]
      (sent: the room is released)
so a watching agent follows one room a round, start to end.

With --dialect mooncake (run with the SGLang venv's Python, where the
mooncake wheel is) the process makes SGLang's Mooncake TransferEngine
instead of a NIXL agent (engine.so mapped and initialized over TCP, as in an
SGLang prefill on its default backend) and the messages are Mooncake's
untagged ones (tests/sglang/mooncake/prefill.py's header):
  [room, ip, port, session, page indices, aux, state, ranks, prefix, device]
      (10 frames, received: the room is enqueued)
  [room, b"4", rank]
      (3 frames, sent: the room is released)

Protocol (JSON lines on stdout, real/common.py's emit; fd 1 goes to stderr):
{"event":"ready","pid":P}, then it waits for "go" on
stdin, runs --rounds rounds and prints
  {"event":"done","rounds":N,"us_per_round":U,"cpu_us_per_round":C}
U the wall-clock time a round took, C the CPU time this thread spent on it
(uprobe traps included: the kernel handles them on the thread that hits
them), which other load on the host hardly changes.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "real"))
from common import claim_stdout, emit  # noqa: E402


def main():
    p = argparse.ArgumentParser(prog="zmq_rate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--room-start", type=int, default=1 << 40)
    p.add_argument("--dialect", choices=("nixl", "mooncake"), default="nixl")
    a = p.parse_args()
    claim_stdout()  # NIXL logs to fd 1: the protocol gets its own
    import zmq

    if a.dialect == "nixl":
        from nixl_cu12 import nixl_agent, nixl_agent_config

        backend = nixl_agent("zmq-rate", nixl_agent_config(backends=[]))
    else:
        os.environ["MOONCAKE_PROTOCOL"] = "tcp"
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        backend = init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0)
        session = backend.get_session_id().encode()
    ctx = zmq.Context()
    path = os.path.join(tempfile.mkdtemp(prefix="stallwatch-zmq-"), "bootstrap")
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{path}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{path}")
    pages = (1).to_bytes(4, "little") * 4
    emit("ready", pid=os.getpid())
    if sys.stdin.readline().strip() != "go":
        return 2
    start = time.perf_counter()
    cpu = time.thread_time()
    for n in range(a.rounds):
        room = str(a.room_start + n).encode()
        if a.dialect == "nixl":
            push.send_multipart([b"NixlMsgGuard", room, b"127.0.0.1", b"40001", b"decode-0", pages, b"1", b"1", b"", b"0", b"0"])
            pull.recv_multipart()
            push.send_multipart([b"KV_STATUS", room, b"4", b"0", b""])
        else:
            push.send_multipart([room, b"127.0.0.1", b"40001", session, pages, b"1", b"", b"1", b"0", b""])
            pull.recv_multipart()
            push.send_multipart([room, b"4", b"0"])
        pull.recv_multipart()
    elapsed = time.perf_counter() - start
    cpu = time.thread_time() - cpu
    emit("done", rounds=a.rounds, us_per_round=elapsed / a.rounds * 1e6, cpu_us_per_round=cpu / a.rounds * 1e6)
    del backend
    return 0


if __name__ == "__main__":
    sys.exit(main())
