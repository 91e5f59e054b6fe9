#!/usr/bin/env python3
"""The decode side of the SGLang test target (see prefill.py, which starts
one of these per decode rank and plays the router for it).

Like SGLang's decode rank (NixlKVManager in DECODE mode plus
CommonKVReceiver): one NIXL agent (UCX, no worker threads, NIXL's own
progress thread), its KV pages and aux slots registered as DRAM; a ZMQ PULL
socket for the prefill's KV_STATUS messages (a listener thread); a PUSH
socket to the prefill's rank port, on which it registers once (room "None":
agent metadata, buffer pointers) and then sends each room's destination
(room as ASCII, page indices, aux slot). It never calls NIXL to move data:
the prefill WRITEs into its pages.

Control on stdin, one command a line (from prefill.py, the "router"):
  req ROOM PAGES REQUIRED   a request for ROOM: allocate PAGES pages, send
                            the destination (REQUIRED = the room's number of
                            destination ranks, SGLang's required_dst_info_num)
  quit
Events on stdout, JSON lines: ready, answered, ignored, abort_sent,
status (KV_STATUS received, with `verified`: the pages and aux slot hold the
room's bytes).

Faults (each names a room; prefill.py stops or kills a decode itself for
the others): --ignore ROOM never answers for it (its destination never
comes); --abort ROOM answers, and as soon as the first byte of the room's first page
lands sends ABORT (what SGLang's decode does when its client goes away),
racing the chunk still in flight.
"""

import argparse
import os
import signal
import threading
import time

import numpy as np

import wire
from wire import KVPoll, emit, log


def make_agent(name):
    from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    # As NixlKVManager on a decode rank: no backend from the config, no UCX
    # worker threads (num_threads is 8 only on prefill), strict locking.
    agent = nixl_agent(name, nixl_agent_config(backends=[], num_threads=0,
                                               sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
    agent.create_backend("UCX", {})
    return agent


class Decode:
    def __init__(self, args):
        self.args = args
        self.kv = np.zeros(args.pages * args.page_size, dtype=np.uint8)
        self.aux = np.zeros(args.aux_slots * 8, dtype=np.uint8)
        self.agent = make_agent(args.agent_name)
        self.agent.register_memory([(self.kv.ctypes.data, self.kv.nbytes, 0, ""),
                                    (self.aux.ctypes.data, self.aux.nbytes, 0, "")], "DRAM")
        self.ctx = wire.zmq.Context()
        self.pull, self.port = wire.bind_pull(self.ctx, args.residue)
        self.push = wire.connect_push(self.ctx, args.prefill_ip, args.prefill_port)
        self.next_page = 0
        self.next_aux = 0
        self.rooms = {}  # room -> (pages, aux slot)
        self.lock = threading.Lock()
        self.abort_watch = None  # (room, first page) until ABORT is sent

    def register(self):
        self.push.send_multipart(wire.registration_frames(
            "127.0.0.1", self.port, self.args.agent_name, self.agent.get_agent_metadata(),
            [self.kv.ctypes.data], [self.aux.ctypes.data], self.args.page_size))

    def allocate(self, npages):
        pages = (self.next_page + np.arange(npages)) % self.args.pages
        self.next_page = int((self.next_page + npages) % self.args.pages)
        aux = self.next_aux
        self.next_aux = (self.next_aux + 1) % self.args.aux_slots
        size = self.args.page_size
        for page in pages:
            self.kv[page * size:(page + 1) * size] = 0
        self.aux[aux * 8:(aux + 1) * 8] = 0
        return pages, aux

    def request(self, room, npages, required):
        a = self.args
        if room in a.ignore:
            emit("ignored", room=room)
            return
        pages, aux = self.allocate(npages)
        with self.lock:
            self.rooms[room] = (pages, aux)
        self.push.send_multipart(wire.transfer_info_frames(
            room, "127.0.0.1", self.port, a.agent_name, pages, aux, required))
        emit("answered", room=room, pages=[int(p) for p in pages], aux=aux)
        if room == a.abort:
            self.abort_watch = (room, int(pages[0]))

    def watch_abort(self):
        room, page = self.abort_watch
        if self.kv[page * self.args.page_size] == 0:
            return
        self.push.send_multipart(wire.abort_frames(room, "127.0.0.1", self.port, 1))
        emit("abort_sent", room=room)
        self.abort_watch = None

    def verified(self, room):
        with self.lock:
            pages, aux = self.rooms.pop(room, (None, None))
        if pages is None:
            return False
        size = self.args.page_size
        for j, page in enumerate(pages):
            if not np.all(self.kv[page * size:(page + 1) * size] == wire.page_pattern(room, j)):
                return False
        return int(self.aux[aux * 8:(aux + 1) * 8].view(np.int64)[0]) == room

    def listen(self):
        """decode_listener_thread: KV_STATUS from the prefill."""
        while True:
            msg = self.pull.recv_multipart()
            if not msg or msg[0] != wire.KV_STATUS_TAG or len(msg) < 4:
                log("decode", f"unexpected message {msg[:1]!r}")
                continue
            room, status = int(msg[1]), int(msg[2])
            reason = msg[4].decode(errors="replace") if len(msg) > 4 else ""
            ok = self.verified(room) if status == KVPoll.Success else False
            emit("status", room=room, status=status, reason=reason, verified=ok)


def main():
    p = argparse.ArgumentParser(prog="decode.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill-ip", default="127.0.0.1")
    p.add_argument("--prefill-port", type=int, required=True)
    p.add_argument("--agent-name", required=True)
    p.add_argument("--residue", type=int, default=None, help="port modulo 4 (picks the prefill worker)")
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--page-size", type=int, default=4096)
    p.add_argument("--aux-slots", type=int, default=64)
    p.add_argument("--ignore", type=int, action="append", default=[])
    p.add_argument("--abort", type=int, default=None)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=150.0)
    args = p.parse_args()

    wire.take_stdout()
    wire.die_with_parent(args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    deadline = time.monotonic() + args.max_seconds
    dec = Decode(args)
    threading.Thread(target=dec.listen, daemon=True).start()
    dec.register()
    emit("ready", pid=os.getpid(), port=dec.port, agent=args.agent_name)
    ctl = wire.LineReader(0)
    while time.monotonic() < deadline:
        for line in ctl.poll(0.0005 if dec.abort_watch else 0.05):
            cmd = line.split()
            if cmd and cmd[0] == "req":
                dec.request(int(cmd[1]), int(cmd[2]), int(cmd[3]))
            elif cmd and cmd[0] == "quit":
                os._exit(0)
        if ctl.eof:
            os._exit(0)
        if dec.abort_watch:
            dec.watch_abort()
    os._exit(3)


if __name__ == "__main__":
    main()
