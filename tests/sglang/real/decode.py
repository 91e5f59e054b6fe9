#!/usr/bin/env python3
"""One decode rank for tests/sglang/real/prefill.py (read its docstring): a
real process running SGLang 0.5.23's NixlKVManager in DECODE mode and one
NixlKVReceiver per room, driven as SGLang's DecodePreallocQueue /
DecodeTransferQueue drive them:

  receiver = NixlKVReceiver(mgr, bootstrap_addr, room)       # Bootstrapping
  mgr.try_ensure_parallel_info(bootstrap_addr)              # GET /route (once)
  receiver.init(prefill_dp_rank=0)   # GET /route per rank, registration frames
  poll() -> WaitingForInput (policy "early"), allocate pages (from a free
  list: in order, or with --free-runs N in shuffled runs of N pages, as
  SGLang's allocator hands them out after churn) and an aux slot,
  receiver.send_metadata(kv_indices, aux_index)             # TransferInfo
  poll() until Success / Failed, then verify the pages, clear().

Commands on stdin (JSON lines, from the prefill acting as the router):
  {"cmd":"room","room":R,"pages":N,"mode":"answer"|"no-answer"|"abort"}
    abort: receiver.abort() (ABORT frames) as soon as the first byte of the
    room's KV lands in this rank's pages.
  {"cmd":"quit"}
Events on stdout: decode_ready, answered, abort_sent, status {room, status,
verified}, busy (no free pages). stderr: SGLang's logs.
"""

import argparse
import os
import queue
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import emit, log  # noqa: E402


class Backend:
    """What a decode rank takes from its transfer backend: NIXL's here, a
    subclass for another (tests/sglang/mooncake/decode.py). Everything else
    of the rank (its command line, SGLang's server args and KV pools, the
    room loop) is `main`'s, the same for every backend."""

    name = "nixl"

    @staticmethod
    def add_args(p):
        p.add_argument("--nixl", default="cu13")

    def before_server_args(self, args):
        """Before SGLang is imported: pick the libnixl build."""
        self.build = common.select_nixl(args.nixl)

    def classes(self):
        """The KV manager and receiver classes, once the server args are
        published."""
        from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver

        return NixlKVManager, NixlKVReceiver

    def ready_fields(self, mgr):
        """What decode_ready says of the backend."""
        return {"agent": mgr.agent.name, "nixl": self.build, "libnixl": common.loaded_libnixl()}


def main(backend=None):
    backend = backend or Backend()
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--mla", action="store_true")
    backend.add_args(p)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--aux-slots", type=int, default=64)
    p.add_argument("--free-runs", type=int, default=0,
                   help="hand pages out in shuffled runs of N (a pool after churn); 0: in order, a fresh pool")
    p.add_argument("--max-seconds", type=float, default=300.0)
    args = p.parse_args()
    common.claim_stdout()
    deadline = time.monotonic() + args.max_seconds

    backend.before_server_args(args)
    import numpy as np

    common.publish_server_args("decode", args.tp_size, args.tp_rank, args.bootstrap_port, backend=backend.name)
    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_server_args

    manager_class, receiver_class = backend.classes()
    pools = common.HostPools(np, layers=args.layers, mla=args.mla, pages=args.pages, page_bytes=args.page_bytes, aux_slots=args.aux_slots)
    if args.free_runs:
        pools.scatter(args.free_runs)
    kv_args = pools.kv_args(KVArgs, engine_rank=args.tp_rank, page_size=args.page_size, mla=args.mla, kv_head_num=1, total_kv_head_num=2)
    mgr = manager_class(kv_args, DisaggregationMode.DECODE, get_server_args(), args.mla)
    addr = f"127.0.0.1:{args.bootstrap_port}"
    emit("decode_ready", pid=os.getpid(), port=mgr.rank_port, tp_rank=args.tp_rank, tp_size=args.tp_size,
         mla=args.mla, **backend.ready_fields(mgr))

    serve(mgr, receiver_class, KVPoll, pools, np, addr, deadline)
    os._exit(0)


def serve(mgr, receiver_class, KVPoll, pools, np, addr, deadline):
    """The decode scheduler's prealloc and transfer queues over the rooms the
    router tells on stdin, until "quit" / EOF or the deadline; shared by
    every backend's decode (tests/sglang/mooncake/decode.py too): SGLang's
    receivers are CommonKVReceivers on either backend."""
    POLL_NAMES = {int(getattr(KVPoll, n)): n for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")}
    commands = queue.Queue()

    def read_stdin():
        for line in sys.stdin:
            import json
            try:
                commands.put(json.loads(line))
            except ValueError:
                pass
        commands.put({"cmd": "quit"})

    threading.Thread(target=read_stdin, daemon=True).start()

    # room -> state: receiver, pages, aux, mode, phase (prealloc | transfer)
    rooms = {}
    while time.monotonic() < deadline:
        try:
            cmd = commands.get(timeout=0.001)
        except queue.Empty:
            cmd = None
        if cmd is not None:
            if cmd.get("cmd") == "quit":
                break
            if cmd.get("cmd") == "room":
                room = int(cmd["room"])
                receiver = receiver_class(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
                if not mgr.try_ensure_parallel_info(addr):
                    log(f"decode: no parallel info from {addr} yet")
                receiver.init(0)
                rooms[room] = {"receiver": receiver, "pages": None, "aux": None, "n": int(cmd["pages"]),
                               "mode": cmd.get("mode", "answer"), "phase": "prealloc", "aborted": False}
        for room, st in list(rooms.items()):
            receiver = st["receiver"]
            status = receiver.poll()
            if st["phase"] == "prealloc":
                if status == KVPoll.WaitingForInput and st["mode"] != "no-answer":
                    pages, aux = pools.alloc(st["n"])
                    if pages is None:
                        continue
                    st["pages"], st["aux"] = pages, aux
                    pools.zero(pages, aux)
                    receiver.send_metadata(np.array(pages, dtype=np.int32), aux)
                    st["phase"] = "transfer"
                    emit("answered", room=room, pages=pages, aux=aux)
                elif status == KVPoll.Failed:
                    st["phase"] = "transfer"
            if st["phase"] != "transfer":
                continue
            if st["mode"] == "abort" and not st["aborted"] and st["pages"] and pools.landed(st["pages"]):
                receiver.abort()
                st["aborted"] = True
                emit("abort_sent", room=room)
                continue
            if status in (KVPoll.Success, KVPoll.Failed):
                verified = status == KVPoll.Success and pools.verify(room, st["pages"], st["aux"])
                reason = None
                if status == KVPoll.Failed:
                    try:
                        receiver.failure_exception()
                    except Exception as e:  # KVTransferError, as the decode scheduler gets it
                        reason = str(e)
                else:
                    receiver.clear()
                emit("status", room=room, status=POLL_NAMES.get(int(status), str(status)), verified=verified, reason=reason)
                if st["pages"] is not None:
                    pools.free(st["pages"], st["aux"])
                del rooms[room]


if __name__ == "__main__":
    main()
