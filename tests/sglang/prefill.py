#!/usr/bin/env python3
"""A test target reproducing SGLang's real prefill flow with real NIXL and
real ZMQ: this process is the prefill side (the one stallwatch watches), and
it starts one decode.py process per decode rank.

SGLang's prefill flow (read from the sglang 0.5.23 wheel, PyPI:
python/sglang/srt/disaggregation/prefill.py, common/conn.py, nixl/conn.py)
----------------------------------------------------------------------------
1. Bootstrap over ZMQ, keyed by room. The router gives every request a
   `bootstrap_room` (a random 63-bit integer) and sends the request to a
   prefill and a decode. Each prefill rank binds one ZMQ PULL socket (its
   "rank port", published with an HTTP PUT to the bootstrap server's /route,
   which decodes GET to find it: that HTTP lookup carries no room). A decode
   rank connects a PUSH socket (RECONNECT_IVL -1, LINGER 0) to it and sends
   multipart messages, every frame a bytes object:
   - once per decode rank, its registration: [b"NixlMsgGuard", b"None", ip,
     port, agent name, NIXL agent metadata, KV pointers (packed u64), aux
     pointers, state pointers, gpu id, tp size, tp rank, item length, ...];
     the prefill's bootstrap thread calls add_remote_agent on it;
   - per room, its destination (TransferInfo): [b"NixlMsgGuard", room as
     ASCII decimal, ip, port, agent name, page indices (int32 bytes), aux
     index, required_dst_info_num, state indices, prefix length, is_dummy].
     When `required_dst_info_num` ranks have answered, the room's status
     goes Bootstrapping -> WaitingForInput;
   - [b"ABORT", room, ip, port, generation] when the decode gives a room up:
     the bootstrap thread sets the room Failed. No NIXL call at all.
   The prefill answers on PUSH sockets to each decode's own PULL port:
   [b"KV_STATUS", room, status (KVPoll: 0 Failed .. 4 Success), rank, reason].
2. Queues. The scheduler holds a request in its bootstrap queue while the
   room is Bootstrapping (a decode that never answers leaves it there until
   SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 s, with no NIXL call and no
   log), runs its forward passes, and for every chunk of a chunked prefill
   calls add_transfer_request; the request then sits in the inflight queue,
   polled for its room status until Success or Failed.
3. Four transfer workers (SGLANG_DISAGGREGATION_QUEUE_SIZE = 4), each a
   thread with its own FIFO. A room's chunks go to worker
   sum(destination ports of its ranks) % 4: one worker per destination, so
   a worker stuck on one transfer holds every later room of its shard, with
   no NIXL call for them. Per chunk the worker, for every destination rank
   of the room (a "peer"), creates one WRITE transfer of the chunk's pages
   (initialize_xfer -> createXferReq) and posts it at once (transfer ->
   postXferReq); on the last chunk it adds per peer the state transfers
   (hybrid models) and one aux transfer. So a request is chunks x peers KV
   handles plus peers aux (and state) handles. It then polls every handle
   (check_xfer_state -> getXferStatus, time.sleep(0) between rounds),
   unbounded while none failed; Success of the last chunk sends KV_STATUS.
4. NIXL. One nixl_agent per rank, nixl_agent_config(backends=[],
   num_threads=8 on prefill / 0 on decode, sync_mode STRICT), then
   create_backend("UCX", {"num_threads": "8"}): UCX's thread-pool engine,
   whose worker threads keep polling progress whether or not a transfer is
   in flight. Transfers are created WITHOUT a notification message
   (notif_msg b""), so the handle carries no room id.
5. Release by garbage collection. SGLang never calls release_xfer_handle:
   nixl_xfer_handle.__del__ calls releaseXferReq when the last reference
   goes. The worker's `handles` list is rebound when it picks its next chunk
   (releasing the chunk's handles), but its locals keep the last KV handle
   until the next chunk that has pages reaches `kv_xfer_handle = None`, and
   the last aux handle until the next last chunk's aux transfer is created.
   On a shard that goes idle, the last room's handles stay unreleased,
   finished and answering SUCCESS, for as long as the shard is idle.

This target
-----------
Same threads, sockets, frames, queues and NIXL calls, in the same order, on
DRAM buffers: a bootstrap thread on a PULL socket, 4 worker threads chosen
by destination port, the scheduler (main thread) with its bootstrap, forward
and inflight stages, NIXL agent with num_threads=8 and no notification
messages, handles released only by garbage collection at the points above.
Not reproduced: the HTTP /route lookup (the decode gets the rank port on its
command line), GPUs, staging buffers, state transfers, the 300 s timeouts.
The "router" is this process: it writes each request's room to its decodes'
stdin (decode.py) and enqueues it here.

Seeded faults (--fault), each on the room --fault-room:
  none          a healthy run; with 2 decodes on workers 0 and 1, workers 2
                and 3 stay idle, and each used worker's last handles stay
                unreleased when traffic stops (--hold keeps it running).
  no-answer     the room's decode never sends its destination: the room
                stays Bootstrapping; no NIXL call is ever made for it.
  decode-dies   the decode answers for the room, then (once its earlier
                rooms concluded) is SIGKILLed: the room's transfers go to a
                dead peer, and its later rooms are never answered.
  hang          when the room is bootstrapped (and the decode's earlier
                rooms concluded), its decode is SIGSTOPped
                (a peer that makes no progress; on UCX over tcp on loopback
                the transfer then stays IN_PROG for as long as the stop
                lasts, no error): the worker polls forever, and the rooms of
                the second decode, whose port is put on the same worker,
                queue behind it. The decode is continued and killed at exit.
                With --no-hang-shared-worker every decode keeps its own
                worker (decode d on worker d % 4, as without a fault): the
                other decodes' rooms keep transferring and completing while
                the stopped decode's transfer hangs (one peer stuck, the
                others alive).
  abort         the decode sends ABORT as soon as the first byte of the
                room's first chunk lands (the chunk still in flight); the
                room turns Failed, its later chunks are never sent, and its
                finished handles stay in the worker until that worker's next
                chunk (none, when the room is the last of its worker).
Default fault room: the first room of decode 0 after the middle of the run;
for abort the last room of decode 0. With hang and decode-dies the requests
after the fault room arrive once the fault is in place.

Marks (--marker LIB, the stallwatch marker library, common/marker): what a
framework adds where it has no native signal. A room is marked enqueued
when the router hands it to the bootstrap queue, transfer_posted when its
first chunk goes to its transfer worker, transfer_done when its last chunk
is done (failed when a transfer fails), released when the scheduler clears
it, aborted when its ABORT arrives. A mark goes before the status change
another thread acts on, so a room's marks are in order.

Transport: UCX_TLS=tcp,self unless --ucx-tls says otherwise ("default"
unsets it): on loopback a stopped peer hangs a tcp transfer at once, while
with cma some writes land in the stopped process first.

Protocol: JSON lines on stdout (fd 1 goes to stderr). After set-up and one
warm-up room per decode (UCX connection set-up out of the way):
  {"event":"ready","prefill_pid":P,"decodes":[{"index","pid","port","worker","agent"}],...}
then it waits for "go" on stdin (attach now) unless --no-wait, and prints
  request {room, decodes, worker}, bootstrapped, chunk {room, chunk, last},
  xfer {room, chunk, kind, peer, handle} (with --events; printed once a
  transfer is created, before its post),
  completed, failed {room, reason}, decode_<event> {decode, ...} (answered,
  ignored, abort_sent, status with `verified`), decode_stopped,
  decode_killed,
  decode_exited, then
  done {completed, failed, verified}        every room concluded, or
  holding {rooms: {room: state}, workers}   nothing moved for --settle s;
  state is completed, failed, bootstrapping, queued (in a worker's queue),
  transferring; workers lists per worker the room it is on and the rooms
  queued behind it. Then it holds until stdin EOF or "quit" (healthy runs
  exit after done unless --hold), a signal, or --max-seconds; always last:
  {"event":"exit","reason":R,"code":C}. Decodes have PR_SET_PDEATHSIG and
  are SIGCONTed and SIGKILLed at exit; os._exit skips finalizers, so no
  handle is released at teardown.

Example (target/venv/bin/python):
  python tests/sglang/prefill.py --count 40 --no-wait
  python tests/sglang/prefill.py --fault hang --count 12
"""

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np

import wire
from wire import KVPoll, Stop, emit, log

FAULTS = ("none", "no-answer", "decode-dies", "hang", "abort")
NUM_THREADS = 8  # NixlKVManager: num_threads = 8 on a prefill rank
WARMUP_ROOM = 10**12


class TransferInfo:
    """One decode rank's destination for one room (from_zmq)."""

    def __init__(self, msg):
        self.room = int(msg[0].decode("ascii"))
        self.endpoint = msg[1].decode("ascii")
        self.dst_port = int(msg[2].decode("ascii"))
        self.agent_name = msg[3].decode("ascii")
        self.dst_kv_indices = np.frombuffer(msg[4], dtype=np.int32)
        self.dst_aux_index = int(msg[5].decode("ascii"))
        self.required_dst_info_num = int(msg[6].decode("ascii"))


class PeerInfo:
    """A decode rank's registration (KVArgsRegisterInfo, the frames used)."""

    def __init__(self, msg):
        self.endpoint = msg[1].decode("ascii")
        self.dst_port = int(msg[2].decode("ascii"))
        self.agent_name = msg[3].decode("ascii")
        self.agent_metadata = msg[4]
        self.dst_kv_ptrs = list(np.frombuffer(msg[5], dtype=np.uint64))
        self.dst_aux_ptrs = list(np.frombuffer(msg[6], dtype=np.uint64))
        self.dst_kv_item_len = int(msg[11].decode("ascii"))


class Chunk:
    """TransferKVChunk."""

    def __init__(self, room, number, prefill_kv_indices, index_slice, is_last_chunk, prefill_aux_index):
        self.room = room
        self.number = number
        self.prefill_kv_indices = prefill_kv_indices
        self.index_slice = index_slice
        self.is_last_chunk = is_last_chunk
        self.prefill_aux_index = prefill_aux_index


class KVManager:
    """The prefill rank's NixlKVManager: NIXL agent, bootstrap thread, the
    four transfer workers, room statuses."""

    def __init__(self, args):
        from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.args = args
        self.page_size = args.page_size
        self.kv = np.zeros(args.pages * args.page_size, dtype=np.uint8)
        self.aux = np.zeros(args.aux_slots * 8, dtype=np.uint8)
        self.agent = nixl_agent("prefill", nixl_agent_config(
            backends=[], num_threads=NUM_THREADS, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        self.agent.create_backend("UCX", {"num_threads": str(NUM_THREADS)})
        self.agent.register_memory([(self.kv.ctypes.data, self.kv.nbytes, 0, ""),
                                    (self.aux.ctypes.data, self.aux.nbytes, 0, "")], "DRAM")
        self.ctx = wire.zmq.Context()
        self.server_socket, self.rank_port = wire.bind_pull(self.ctx, None)
        self.lock = threading.Lock()
        self.request_status = {}
        self.transfer_infos = {}
        self.decode_kv_args_table = {}
        self.failure_records = {}
        self.sockets = {}
        self.transfer_queues = [queue.Queue() for _ in range(wire.SHARDS)]
        # Observability for the "holding" summary only: what each worker is
        # on and which rooms wait in its queue.
        self.worker_room = [None] * wire.SHARDS
        self.queued = [[] for _ in range(wire.SHARDS)]
        self.poll_sleep = args.poll_sleep
        self.current = threading.local()  # the chunk a worker is on, for --events
        self.marker = load_marker(args.marker)

    def mark(self, room, stage):
        """--marker: where SGLang has no native signal, the framework's own
        mark (stallwatch_mark) of the room's stage."""
        if self.marker is not None and room < WARMUP_ROOM:
            self.marker.mark(room, stage)

    def start(self):
        for i, q in enumerate(self.transfer_queues):
            threading.Thread(target=self.transfer_worker, args=(q, i), daemon=True).start()
        threading.Thread(target=self.bootstrap_thread, daemon=True).start()

    # ---- statuses ------------------------------------------------------
    def check_status(self, room):
        return self.request_status.get(room, KVPoll.WaitingForInput)

    def update_status(self, room, status):
        with self.lock:
            current = self.request_status.get(room)
            if current is None:
                if status in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
                    self.request_status[room] = status
            elif status == KVPoll.Failed:
                self.request_status[room] = KVPoll.Failed
            elif current != KVPoll.Failed:
                self.request_status[room] = max(current, status)

    def conclude_transfer(self, room, status, reason=""):
        if room not in self.request_status:
            return
        if status == KVPoll.Success and room in self.failure_records:
            status, reason = KVPoll.Failed, self.failure_records[room]
        if self.marker is not None:  # before the status the scheduler acts on
            self.mark(room, self.marker.TRANSFER_DONE if status == KVPoll.Success else self.marker.FAILED)
        self.update_status(room, status)
        infos = self.transfer_infos.get(room) or {}
        for target in {(i.endpoint, i.dst_port) for i in list(infos.values())}:
            try:
                self.send_multipart_locked(target, wire.kv_status_frames(room, status, reason))
            except Exception as e:  # a dead decode: SGLang logs and goes on
                log("prefill", f"KV_STATUS of room {room} to {target}: {e}")

    def send_multipart_locked(self, target, parts):
        with self.lock:
            entry = self.sockets.get(target)
            if entry is None:
                entry = (wire.connect_push(self.ctx, *target), threading.Lock())
                self.sockets[target] = entry
        sock, lock = entry
        with lock:
            sock.send_multipart(parts)

    # ---- the bootstrap thread ----------------------------------------
    def bootstrap_thread(self):
        while True:
            msg = self.server_socket.recv_multipart()
            if msg[0] == wire.ABORT_TAG:
                room = int(msg[1].decode("ascii"))
                if room in self.request_status and self.check_status(room) != KVPoll.Success:
                    self.failure_records[room] = "Aborted by decode-side abort notification."
                    if self.marker is not None:
                        self.mark(room, self.marker.ABORTED)
                    self.update_status(room, KVPoll.Failed)
                continue
            if msg[0] != wire.GUARD:
                log("prefill", f"foreign traffic {msg[0][:20]!r}")
                continue
            msg = msg[1:]
            if msg[0] == b"None":
                peer = PeerInfo(msg)
                if peer.agent_name not in self.decode_kv_args_table:
                    self.agent.add_remote_agent(peer.agent_metadata)
                    self.decode_kv_args_table[peer.agent_name] = peer
                continue
            info = TransferInfo(msg)
            self.transfer_infos.setdefault(info.room, {})[info.agent_name] = info
            if len(self.transfer_infos[info.room]) == info.required_dst_info_num:
                self.update_status(info.room, KVPoll.WaitingForInput)

    # ---- transfers -----------------------------------------------------
    def add_transfer_request(self, room, number, kv_indices, index_slice, is_last_chunk, aux_index):
        if room not in self.transfer_infos:
            return None
        shard = self.shard_of(room)
        if number == 0 and self.marker is not None:
            self.mark(room, self.marker.TRANSFER_POSTED)
        self.queued[shard].append(room)
        self.transfer_queues[shard].put(Chunk(room, number, kv_indices, index_slice, is_last_chunk, aux_index))
        return shard

    def shard_of(self, room):
        return sum(i.dst_port for i in self.transfer_infos[room].values()) % wire.SHARDS

    def _xfer(self, peer_name, src, dst, kind):
        """initialize_xfer + transfer: created and posted back to back, no
        notification message."""
        src_descs = self.agent.get_xfer_descs(src, "DRAM")
        dst_descs = self.agent.get_xfer_descs(dst, "DRAM")
        xfer_handle = self.agent.initialize_xfer("WRITE", src_descs, dst_descs, peer_name)
        if not xfer_handle:
            raise Exception("KVSender failed to create transfer")
        self.created(kind, peer_name, xfer_handle)
        if self.agent.transfer(xfer_handle) == "ERR":
            raise Exception("KVSender failed to post transfer")
        return xfer_handle

    def send_kvcache(self, peer_name, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices):
        size = self.page_size
        base = self.kv.ctypes.data
        src = [(base + int(p) * size, size, 0) for p in prefill_kv_indices]
        dst = [(int(dst_kv_ptrs[0]) + int(p) * size, size, 0) for p in dst_kv_indices]
        return self._xfer(peer_name, src, dst, "kv")

    def send_aux(self, peer_name, prefill_aux_index, dst_aux_ptrs, dst_aux_index):
        src = [(self.aux.ctypes.data + 8 * prefill_aux_index, 8, 0)]
        dst = [(int(dst_aux_ptrs[0]) + 8 * dst_aux_index, 8, 0)]
        return self._xfer(peer_name, src, dst, "aux")

    def created(self, kind, peer, handle):
        """--events: one line per transfer, once created and before its
        post (which may fail at once), with its handle (the key the nixl
        profile sees)."""
        kv_chunk = self.current.chunk
        if self.args.events and kv_chunk.room < WARMUP_ROOM:
            emit("xfer", room=kv_chunk.room, chunk=kv_chunk.number, kind=kind, peer=peer, handle=hex(handle._handle))

    def await_handles(self, handles):
        """_await_handles, healthy path: unbounded while nothing failed."""
        while True:
            settled, failed = True, False
            for handle in handles:
                state = self.agent.check_xfer_state(handle)
                if state == "ERR":
                    failed = True
                elif state != "DONE":
                    settled = False
            if settled or failed:
                return settled, failed
            time.sleep(self.poll_sleep)

    def transfer_worker(self, q, worker_index):
        # The locals below are named and rebound where SGLang's are, so the
        # handles are garbage-collected (nixl_xfer_handle.__del__ ->
        # releaseXferReq) at the same points: see the module doc, point 5.
        while True:
            kv_chunk = q.get()
            self.current.chunk = kv_chunk
            room = kv_chunk.room
            self.queued[worker_index].remove(room)
            handles = []
            try:
                if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
                    continue
                room_transfer_infos = self.transfer_infos.get(room)
                if room_transfer_infos is None:
                    continue
                self.worker_room[worker_index] = room
                self.update_status(room, KVPoll.Transferring)
                for req in list(room_transfer_infos.values()):
                    dst_info = self.decode_kv_args_table[req.agent_name]
                    if len(kv_chunk.prefill_kv_indices) > 0:
                        kv_xfer_handle = None
                        chunked_dst_kv_indice = req.dst_kv_indices[kv_chunk.index_slice]
                        kv_xfer_handle = self.send_kvcache(req.agent_name, kv_chunk.prefill_kv_indices,
                                                           dst_info.dst_kv_ptrs, chunked_dst_kv_indice)
                        handles.append(kv_xfer_handle)
                    if kv_chunk.is_last_chunk:
                        aux_xfer_handle = self.send_aux(req.agent_name, kv_chunk.prefill_aux_index,
                                                        dst_info.dst_aux_ptrs, req.dst_aux_index)
                        handles.append(aux_xfer_handle)
                settled, any_failed = self.await_handles(handles)
                if any_failed:
                    raise RuntimeError(f"NIXL transfer encountered ERR room={room}")
                if kv_chunk.is_last_chunk:
                    self.conclude_transfer(room, KVPoll.Success)
            except Exception as e:
                log("prefill", f"transfer worker {worker_index}, room {room}: {type(e).__name__}: {e}")
                self.failure_records.setdefault(room, str(e))
                self.conclude_transfer(room, KVPoll.Failed, str(e))
            finally:
                self.worker_room[worker_index] = None


class Request:
    def __init__(self, index, room, decodes, npages, nchunks):
        self.index = index
        self.room = room
        self.decodes = decodes
        self.npages = npages
        self.nchunks = nchunks
        self.pages = None
        self.aux = None
        self.sent = 0  # chunks handed to the KV manager
        self.next_at = 0.0
        self.done = None  # "completed" | "failed"


class DecodeProc:
    """A decode.py child and the thread forwarding its JSON lines."""

    def __init__(self, index, proc):
        self.index = index
        self.proc = proc
        self.info = None
        self.events = queue.Queue()
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for raw in self.proc.stdout:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            self.events.put(rec)
        self.events.put({"event": "eof"})

    def send(self, line):
        try:
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False


class Prefill:
    def __init__(self, args):
        self.args = args
        self.started = time.monotonic()
        self.deadline = self.started + args.max_seconds
        self.stdin = wire.LineReader(0)
        self.pending_lines = []
        self.mgr = None
        self.decodes = []
        self.requests = {}
        self.next_page = 0
        self.next_aux = 0
        self.verified = set()
        self.holding = False  # past "done"/"holding": the run's end is not an error
        self.waiting_go = False  # stdin EOF is expected only once "go" came
        self.last_change = time.monotonic()

    # ---- stop conditions ------------------------------------------------
    def check_stop(self, timeout=0.0):
        if time.monotonic() > self.deadline:
            raise Stop("max-seconds", 3 if self.args.fault == "none" and not self.holding else 0)
        if self.args.no_wait:
            if timeout > 0:
                time.sleep(timeout)
            return
        for line in self.stdin.poll(timeout):
            if line in ("quit", "exit", "stop"):
                raise Stop("quit")
            self.pending_lines.append(line)
        if self.stdin.eof and not self.waiting_go:
            raise Stop("stdin-eof")

    # ---- set-up -----------------------------------------------------------
    def decode_args(self, d):
        a = self.args
        residue = d % wire.SHARDS
        if a.fault == "hang" and a.hang_shared_worker:
            residue = 0  # every decode on worker 0: rooms queue behind the hung one
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode.py"),
               "--prefill-port", str(self.mgr.rank_port), "--agent-name", f"decode-{d}",
               "--residue", str(residue), "--pages", str(a.decode_pages), "--page-size", str(a.page_size),
               "--parent-pid", str(os.getpid()), "--max-seconds", str(a.max_seconds + 30)]
        room = self.fault_room
        if d == self.fault_decode:
            if a.fault == "no-answer":
                cmd += ["--ignore", str(room)]
            elif a.fault == "abort":
                cmd += ["--abort", str(room)]
        return cmd

    def plan(self):
        """Rooms, their decodes, and the fault room."""
        a = self.args
        n = a.decodes
        for i in range(a.count):
            decodes = [(i + k) % n for k in range(a.peers)]
            self.requests[a.room_start + i] = Request(i, a.room_start + i, decodes, a.pages_per_request, a.chunks)
        if a.fault_room is not None:
            self.fault_room = a.fault_room
        elif a.fault == "abort":
            self.fault_room = a.room_start + max(i for i in range(a.count) if i % n == 0)
        else:
            self.fault_room = a.room_start + (a.count // 2 // n) * n
        if a.fault != "none" and self.fault_room not in self.requests:
            raise Stop(f"--fault-room {self.fault_room} is not one of the rooms "
                       f"{a.room_start}..{a.room_start + a.count - 1}", 2)
        self.fault_decode = self.requests[self.fault_room].decodes[0] if a.fault != "none" else None

    def setup(self):
        a = self.args
        self.mgr = KVManager(a)
        self.mgr.start()
        self.plan()
        for d in range(a.decodes):
            proc = subprocess.Popen(self.decode_args(d), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    env=os.environ.copy(), close_fds=True)
            self.decodes.append(DecodeProc(d, proc))
        for dec in self.decodes:
            rec = self.decode_event(dec, "ready", timeout=60)
            dec.info = rec
        end = time.monotonic() + 30
        while len(self.mgr.decode_kv_args_table) < a.decodes:
            if time.monotonic() > end:
                raise RuntimeError("the decodes never registered")
            self.check_stop(0.01)
        # Warm-up: one room per decode pays the UCX connection set-up.
        for dec in self.decodes:
            room = WARMUP_ROOM + dec.index
            req = Request(-1, room, [dec.index], 1, 1)
            self.route(req, quiet=True)
            while not self.step_request(req, quiet=True):
                self.check_stop(0.002)
            self.drain_decode_events(quiet=True)

    def decode_event(self, dec, what, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                rec = dec.events.get(timeout=0.05)
            except queue.Empty:
                self.check_stop()
                continue
            if rec.get("event") == what:
                return rec
            if rec.get("event") == "eof":
                raise RuntimeError(f"decode {dec.index} exited (code {dec.proc.poll()}) before {what}")
        raise RuntimeError(f"decode {dec.index} never said {what}")

    # ---- the router and the scheduler ---------------------------------
    def route(self, req, quiet=False):
        """Dispatch a request: to its decodes (they answer with its
        destination), and into this prefill's bootstrap queue."""
        self.mgr.update_status(req.room, KVPoll.Bootstrapping)
        if self.mgr.marker is not None:
            self.mgr.mark(req.room, self.mgr.marker.ENQUEUED)
        for d in req.decodes:
            if not self.decodes[d].send(f"req {req.room} {req.npages} {len(req.decodes)}") and not quiet:
                emit("undeliverable", room=req.room, decode=d)
        if not quiet:
            ports = [self.decodes[d].info["port"] for d in req.decodes]
            emit("request", room=req.room, decodes=req.decodes, worker=sum(ports) % wire.SHARDS)

    def forward(self, req):
        """The forward pass: the room's KV pages and aux slot get its bytes."""
        a = self.args
        req.pages = (self.next_page + np.arange(req.npages)) % a.pages
        self.next_page = int((self.next_page + req.npages) % a.pages)
        req.aux = self.next_aux
        self.next_aux = (self.next_aux + 1) % a.aux_slots
        kv = self.mgr.kv
        for j, page in enumerate(req.pages):
            kv[page * a.page_size:(page + 1) * a.page_size] = wire.page_pattern(req.room, j)
        self.mgr.aux[req.aux * 8:(req.aux + 1) * 8] = np.array([req.room], dtype=np.int64).view(np.uint8)

    def step_request(self, req, quiet=False):
        """One scheduler step for one request; True once it concluded."""
        mgr = self.mgr
        status = mgr.check_status(req.room) if req.room in mgr.request_status else KVPoll.Failed
        if req.sent == 0:
            if status == KVPoll.Bootstrapping:
                return False
            if status == KVPoll.WaitingForInput:
                if self.args.fault in ("hang", "decode-dies") and req.room == self.fault_room:
                    # The fault hits this room alone: the decode's earlier
                    # rooms conclude first.
                    if any(not r.done and r.index < req.index and self.fault_decode in r.decodes
                           for r in self.requests.values()):
                        return False
                    self.stop_decode(self.decodes[self.fault_decode],
                                     signal.SIGSTOP if self.args.fault == "hang" else signal.SIGKILL)
                if not quiet:
                    emit("bootstrapped", room=req.room)
                self.forward(req)
        now = time.monotonic()
        if status not in (KVPoll.Success, KVPoll.Failed) and req.sent < req.nchunks and now >= req.next_at:
            if self.args.fault == "abort" and req.room == self.fault_room and req.sent > 0:
                # Hold the next forward pass until the decode has aborted
                # (the sender then sends no more chunks), at most 5 s.
                if now < req.next_at + 5.0:
                    return False
            per = -(-req.npages // req.nchunks)
            sl = slice(req.sent * per, min(req.npages, (req.sent + 1) * per))
            last = req.sent == req.nchunks - 1
            mgr.add_transfer_request(req.room, req.sent, req.pages[sl], sl, last, req.aux if last else None)
            if not quiet:
                emit("chunk", room=req.room, chunk=req.sent, last=last)
            req.sent += 1
            req.next_at = now + self.args.step
            return False
        if status == KVPoll.Success:
            req.done = "completed"
        elif status == KVPoll.Failed:
            req.done = "failed"
        else:
            return False
        if not quiet:
            if req.done == "completed":
                emit("completed", room=req.room)
            else:
                emit("failed", room=req.room, reason=mgr.failure_records.get(req.room, ""))
        # sender.clear()
        if req.done == "completed" and mgr.marker is not None:
            mgr.mark(req.room, mgr.marker.RELEASED)
        mgr.request_status.pop(req.room, None)
        mgr.transfer_infos.pop(req.room, None)
        return True

    def fault_pending(self, req):
        """Requests after the room a stop or kill is seeded on come once the
        fault is in place (its forward pass ran), so the fault hits that
        room and later rooms meet it."""
        if self.args.fault not in ("hang", "decode-dies"):
            return False
        fault = self.requests[self.fault_room]
        return req.index > fault.index and fault.sent == 0 and not fault.done

    def stop_decode(self, dec, sig):
        """The seeded fault on a decode: SIGSTOP (a peer that makes no
        progress) or SIGKILL (a decode that dies after answering)."""
        os.kill(dec.proc.pid, sig)
        end = time.monotonic() + 5
        while proc_state(dec.proc.pid) not in (("T", "t") if sig == signal.SIGSTOP else ("Z", "X", None)):
            if time.monotonic() > end:
                raise RuntimeError(f"decode {dec.proc.pid} did not take {signal.Signals(sig).name}")
            time.sleep(0.001)
        emit("decode_stopped" if sig == signal.SIGSTOP else "decode_killed", decode=dec.index, pid=dec.proc.pid)

    def drain_decode_events(self, quiet=False):
        for dec in self.decodes:
            while True:
                try:
                    rec = dec.events.get_nowait()
                except queue.Empty:
                    break
                event = rec.pop("event")
                if event == "eof":
                    code = dec.proc.wait()
                    if not quiet:
                        emit("decode_exited", decode=dec.index, pid=dec.proc.pid, code=code)
                    continue
                if event == "status" and rec.get("verified"):
                    self.verified.add(rec["room"])
                if not quiet and rec.get("room", 0) < WARMUP_ROOM:
                    emit("decode_" + event, decode=dec.index, **rec)
                self.last_change = time.monotonic()

    def ready(self):
        a = self.args
        emit("ready", prefill_pid=os.getpid(), rank_port=self.mgr.rank_port, fault=a.fault,
             fault_room=self.fault_room if a.fault != "none" else None, count=a.count,
             room_start=a.room_start, ucx_tls=os.environ.get("UCX_TLS", "default"),
             decodes=[{"index": d.index, "pid": d.proc.pid, "port": d.info["port"],
                       "worker": d.info["port"] % wire.SHARDS, "agent": d.info["agent"]} for d in self.decodes],
             setup_seconds=round(time.monotonic() - self.started, 3))
        if a.no_wait:
            return
        self.waiting_go = True
        while True:
            while self.pending_lines:
                if self.pending_lines.pop(0) == "go":
                    self.waiting_go = False
                    return
            if self.stdin.eof:
                raise Stop("stdin-eof")
            self.check_stop(0.1)

    def room_state(self, req):
        if req.done:
            return req.done
        if req.room in self.mgr.worker_room:
            return "transferring"
        if any(req.room in rooms for rooms in self.mgr.queued):
            return "queued"
        if req.sent == 0 and self.mgr.request_status.get(req.room) == KVPoll.Bootstrapping:
            return "bootstrapping"
        return "transferring"

    def run(self):
        a = self.args
        rooms = sorted(self.requests)
        issued = 0
        live = []
        next_issue = time.monotonic()
        while True:
            now = time.monotonic()
            if issued < len(rooms) and now >= next_issue and not self.fault_pending(self.requests[rooms[issued]]):
                req = self.requests[rooms[issued]]
                self.route(req)
                live.append(req)
                issued += 1
                next_issue = now + a.interval
                self.last_change = now
            for req in list(live):
                before = (req.sent, req.done)
                if self.step_request(req):
                    live.remove(req)
                if (req.sent, req.done) != before:
                    self.last_change = time.monotonic()
            self.drain_decode_events()
            if issued == len(rooms):
                if not live and (a.fault != "none" or self.all_verified() or now - self.last_change > 5):
                    break
                if live and now - self.last_change > a.settle:
                    break
            self.check_stop(0.001)
        done = [r for r in self.requests.values() if r.done]
        if not live:
            emit("done", completed=sum(r.done == "completed" for r in done),
                 failed=sum(r.done == "failed" for r in done),
                 verified=len(self.verified & set(self.requests)))
            if a.fault == "none" and not a.hold:
                return
        self.holding = True
        emit("holding", fault=a.fault, fault_room=self.fault_room if a.fault != "none" else None,
             rooms={str(r.room): self.room_state(r) for r in self.requests.values()},
             workers=[{"worker": w, "on": self.mgr.worker_room[w], "queued": list(dict.fromkeys(self.mgr.queued[w]))}
                      for w in range(wire.SHARDS)])
        while True:
            self.drain_decode_events()
            self.check_stop(0.05)

    def all_verified(self):
        completed = {r.room for r in self.requests.values() if r.done == "completed"}
        return completed <= self.verified

    def cleanup(self):
        for dec in self.decodes:
            if dec.proc.poll() is None:
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    try:
                        os.kill(dec.proc.pid, sig)
                    except ProcessLookupError:
                        pass
                try:
                    dec.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    log("prefill", f"decode {dec.proc.pid} did not die")


def load_marker(path):
    """The stallwatch marker library, through its ctypes wrapper."""
    if path is None:
        return None
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../common/marker/python"))
    from stallwatch_marker import Marker

    return Marker(path)


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="prefill.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="SGLang's prefill flow (bootstrap over ZMQ, 4 transfer workers, NIXL with num_threads, "
                    "GC release) against decode.py processes, with seeded faults. JSON lines on stdout.",
        epilog="Seeded faults" + __doc__.split("Seeded faults", 1)[1].split("Transport:", 1)[0].rstrip())
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-room", type=int, default=None, help="the room the fault hits (default: see below)")
    p.add_argument("--count", type=int, default=20, help="requests (default: 20)")
    p.add_argument("--decodes", type=int, default=2, help="decode ranks, one process each (default: 2)")
    p.add_argument("--peers", type=int, default=1, help="decode ranks per room (default: 1)")
    p.add_argument("--chunks", type=int, default=2, help="chunks per request (default: 2)")
    p.add_argument("--pages-per-request", type=int, default=4)
    p.add_argument("--page-size", type=int, default=4096)
    p.add_argument("--pages", type=int, default=512, help="prefill KV pool, pages")
    p.add_argument("--decode-pages", type=int, default=512, help="decode KV pool, pages")
    p.add_argument("--aux-slots", type=int, default=64)
    p.add_argument("--room-start", type=int, default=1000)
    p.add_argument("--interval", type=float, default=0.005, help="seconds between requests (default: 0.005)")
    p.add_argument("--step", type=float, default=0.002, help="seconds between a request's chunks (default: 0.002)")
    p.add_argument("--poll-sleep", type=float, default=0.0,
                   help="sleep between status-poll rounds of a worker; SGLang's is 0 (default: 0)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="faults: seconds without change before 'holding' (default: 1)")
    p.add_argument("--hold", action="store_true", help="healthy: keep running after 'done' until stdin EOF")
    p.add_argument("--hang-shared-worker", action=argparse.BooleanOptionalAction, default=True,
                   help="hang: put every decode on worker 0, so the other decodes' rooms queue behind the hung "
                        "transfer (default); --no-hang-shared-worker: each decode keeps its own worker, so they "
                        "keep completing")
    p.add_argument("--marker", default=None, metavar="LIB",
                   help="mark each room's stages with the stallwatch marker library LIB (see the module doc)")
    p.add_argument("--events", action="store_true",
                   help="print an 'xfer' line per transfer created: room, chunk, kind (kv|aux), peer, handle")
    p.add_argument("--no-wait", action="store_true", help="do not wait for 'go'; ignore stdin")
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for every process (default: tcp,self; 'default' unsets it)")
    p.add_argument("--max-seconds", type=float, default=120.0)
    a = p.parse_args(argv)
    if a.count < 1 or a.decodes < 1 or not 1 <= a.peers <= a.decodes or a.chunks < 1 \
            or a.pages_per_request < a.chunks:
        p.error("need --count >= 1, 1 <= --peers <= --decodes, 1 <= --chunks <= --pages-per-request")
    if a.fault == "hang" and a.decodes < 2:
        p.error("--fault hang needs a second decode to queue behind the hung one")
    return a


def main():
    args = parse_args(sys.argv[1:])
    wire.take_stdout()
    tls = args.ucx_tls if args.ucx_tls is not None else os.environ.get("UCX_TLS", "tcp,self")
    if tls == "default":
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = tls

    def on_signal(signum, _frame):
        raise Stop(signal.Signals(signum).name)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)

    def on_alarm(_signum, _frame):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(10)
        raise Stop("max-seconds")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.max_seconds) + 5)
    pre = Prefill(args)
    code, reason = 0, "done"
    try:
        pre.setup()
        pre.ready()
        pre.run()
    except Stop as e:
        reason, code = e.reason, e.code
    except Exception as e:  # noqa: BLE001 - any failure is a protocol error line
        reason, code = "error", 1
        try:
            emit("error", message=f"{type(e).__name__}: {e}")
        except Stop:
            pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        pre.cleanup()
    try:
        emit("exit", reason=reason, code=code)
    except Stop:
        pass
    os._exit(code)


if __name__ == "__main__":
    main()
