#!/usr/bin/env python3
"""SGLang's default PD transfer backend as a test target: this process is an
SGLang prefill rank running SGLang 0.5.23's own MooncakeKVBootstrapServer,
MooncakeKVManager (PREFILL) and MooncakeKVSender, imported unchanged from the
sglang wheel, over the real Mooncake TransferEngine from the
mooncake-transfer-engine-non-cuda 0.3.13.post1 wheel (mooncake/engine.so),
TCP on loopback, P2PHANDSHAKE metadata (no etcd, no metadata server). The
decode ranks are separate processes (decode.py here: MooncakeKVManager
(DECODE) and MooncakeKVReceiver).

This is the NIXL target (tests/sglang/real/prefill.py) with the Mooncake
backend: the router, tokenizer -> scheduler IPC, scheduler loop, detokenizer,
decode room loop, fault seeding and JSON-lines protocol are that file's
(`Target`, `main`, decode.serve), read its docstring for them. This file
only sets the backend up. Installed by `cargo run --release -p xtask --
setup --python` (Debian libibverbs1 / libnl-3-200 / libnl-route-3-200, which
engine.so links even for TCP; the wheel as a layer of the SGLang venv, see
xtask/src/setup.rs).

What this target supplies instead of a server (besides what the NIXL
target's header lists: ServerArgs published as run_scheduler_process does,
KVArgs over numpy host buffers, the router, tokenizer and detokenizer, the
scheduler loops)
-----------------------------------------------------------------------
- The process's shared TransferEngine, made as the scheduler's model runner
  set-up makes it: SGLang's own maybe_init_shared_mooncake_transfer_engine
  (gpu_id=0), with SGLANG_HOST_IP=127.0.0.1 (get_local_ip_auto) and
  MOONCAKE_PROTOCOL=tcp (SGLang's env; default rdma): engine.initialize(
  "127.0.0.1", "P2PHANDSHAKE", "tcp", ""). Its session id is
  "127.0.0.1:<rpc port>".
- With the worker-dies fault only, the fault room's first chunk carries a
  FaultedEvent as its indices_event (the scheduler's CUDA event, which
  this GPU-less host has none of).
- MC_TRANSFER_TIMEOUT (read by the engine, seconds, minimum 5): set only by
  --transfer-timeout (the `timeout` fault sets 5); the engine's default is 30.
- SGLANG_DISAGGREGATION_QUEUE_SIZE (transfer workers, SGLang's default 4) is
  left alone unless --queue-size is given.
Nothing on the transfer path is stubbed or wrapped.

What SGLang's Mooncake code does (sglang/srt/disaggregation/mooncake/conn.py,
srt/distributed/device_communicators/mooncake_transfer_engine.py)
-----------------------------------------------------------------------
- Bootstrap server: the common aiohttp /route server (MooncakeKVBootstrapServer
  = CommonKVBootstrapServer).
- Prefill manager: registers KV and aux with engine.batch_register_memory; a
  bootstrap thread on its ZMQ PULL socket; SGLANG_DISAGGREGATION_QUEUE_SIZE
  (4) transfer worker threads, each with a ThreadPoolExecutor it uses only
  for custom memory pools (not here); a failed-session probe thread.
  A room's chunks go to worker sum(rpc ports of the room's destination
  sessions) % 4 (add_transfer_request), not the ZMQ ports.
- Decode -> prefill frames (untagged; decode's build_receiver_* methods):
  registration ["None", ip, zmq port, session "ip:rpc_port", kv ptrs (u64),
  aux ptrs, state ptrs, tp rank, attn tp size, kv item len, ... kv item
  lens] (20 frames); per room [room, ip, zmq port, session, kv page indices
  (int32), aux index, state indices, required_dst_info_num, decode prefix
  len, device kv indices] (10 frames); ABORT frames as NIXL's (common code).
- Per chunk and destination session, the worker thread itself (no executor)
  makes ONE synchronous batch: engine.batch_transfer_sync_write(session,
  srcs, dsts, lens) (every layer's contiguous runs in one batch); on the last
  chunk one more for the aux. Non-zero return: the session is blacklisted
  (failed_sessions; every later room to it fails at once with "Decode
  instance could be dead") and the room fails ("Failed to send kv chunk of
  ROOM to ip:port"). Success of the aux batch -> KV_STATUS to the decode.

Mooncake-only flags
  --transfer-timeout S   MC_TRANSFER_TIMEOUT for the prefill's engine.
  --queue-size N         SGLANG_DISAGGREGATION_QUEUE_SIZE.
Faults (--fault): those of the NIXL target (none, no-answer,
bootstrap-timeout, decode-dies, hang, abort, prefill-abort), plus
  timeout   hang with MC_TRANSFER_TIMEOUT = --transfer-timeout (default 5 s
            for this fault): the decode rank is SIGSTOPped once the room is
            bootstrapped; the worker's batch for the room's first chunk
            stays busy until the engine's timeout, batch_transfer_sync_write
            returns -1 (freeBatchID refuses the busy batch, which leaks), the
            room fails and the session is blacklisted, so the rooms queued
            behind it on that worker fail at once.
  hang keeps the engine's default timeout (30 s): for a test's lifetime the
  batch is simply hung and the rooms behind it wait.
  worker-dies  once every earlier room concluded (so the agent has seen
            each decode's rooms on the worker), the fault room's first
            chunk goes with an indices_event
            whose synchronize() raises (FaultedEvent: what a CUDA event
            does after a device fault): SGLang's transfer worker raises
            "Transfer thread failed ..." and its thread ends; the room and
            every room of that worker's queue wait for good, no batch, no
            status, no failure.
`ready` carries sglang, mooncake (the wheel version), engine_so (the mapped
engine.so), session (the prefill engine's), queue_size; each decode its
session. `bootstrapped` carries SGLang's worker for the room; `holding`
transfer_threads, {native thread id: alive} of SGLang's transfer workers.

Example:
  PY=$(cat target/sglang-venv)/bin/python
  $PY tests/sglang/mooncake/prefill.py --count 10 --no-wait
  $PY tests/sglang/mooncake/prefill.py --fault timeout --no-wait --settle 10
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../real"))
import prefill as real  # noqa: E402

MOONCAKE_VERSION = "0.3.13.post1"
FAULTS = real.FAULTS + ("timeout", "worker-dies")


class FaultedEvent:
    """What the scheduler hands SGLang's sender with a chunk instead of the
    CUDA event its page indices are ready at (indices_event; no GPU here):
    its synchronize() raises as torch.cuda.Event.synchronize does after a
    device fault."""

    def synchronize(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def engine_so():
    """The mooncake/engine.so this process mapped (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[-1].endswith("/mooncake/engine.so"):
                return fields[-1]
    return None


class MooncakeTarget(real.Target):
    STOP_FAULTS = ("hang", "timeout")
    QUIET_FAULTS = ("worker-dies",)
    DECODE_SCRIPT = os.path.join(HERE, "decode.py")

    @staticmethod
    def configure_env(args):
        os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
        os.environ["MOONCAKE_PROTOCOL"] = "tcp"
        if args.fault == "timeout" and args.transfer_timeout is None:
            args.transfer_timeout = 5
        if args.transfer_timeout is not None:
            os.environ["MC_TRANSFER_TIMEOUT"] = str(args.transfer_timeout)
        if args.queue_size is not None:
            os.environ["SGLANG_DISAGGREGATION_QUEUE_SIZE"] = str(args.queue_size)

    def init_backend(self):
        real.common.publish_server_args("prefill", 1, 0, self.bootstrap_port, backend="mooncake")
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            get_mooncake_transfer_engine,
            maybe_init_shared_mooncake_transfer_engine,
        )

        maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
        self.engine = get_mooncake_transfer_engine()
        if self.engine is None:
            raise SystemExit("SGLang made no Mooncake TransferEngine: is the transfer backend 'mooncake'?")
        from sglang.srt.disaggregation.mooncake.conn import (
            MooncakeKVBootstrapServer,
            MooncakeKVManager,
            MooncakeKVSender,
        )

        return MooncakeKVBootstrapServer, MooncakeKVManager, MooncakeKVSender

    def send_chunk(self, st, pages, k):
        if self.args.fault == "worker-dies" and st["room"] == self.fault_room and k == 0:
            st["sender"].send(pages, indices_event=FaultedEvent())
        else:
            st["sender"].send(pages)

    def holding_fields(self):
        """SGLang's transfer worker threads (the manager's threads whose
        default name names their target): {native thread id: alive}."""
        threads = [t for t in self.mgr._worker_threads if "(transfer_worker)" in t.name]
        return {"transfer_threads": {str(t.native_id): t.is_alive() for t in threads}}

    def decode_args(self):
        return []

    def worker_of(self, room):
        """SGLang's add_transfer_request: sum of the destination sessions'
        rpc ports modulo the queue count."""
        sessions = self.mgr.transfer_infos.get(room, {}).keys()
        return sum(int(s.rsplit(":", 1)[1]) for s in sessions) % len(self.mgr.transfer_queues)

    def ready_fields(self):
        return {"mooncake": MOONCAKE_VERSION, "engine_so": engine_so(), "session": self.engine.get_session_id(),
                "queue_size": len(self.mgr.transfer_queues),
                "transfer_timeout": self.args.transfer_timeout}

    def decode_fields(self, d):
        return {"session": d["info"]["session"]}


def main(argv):
    p = real.build_parser(prog="mooncake/prefill.py", transfer="Mooncake (TCP)", faults=FAULTS)
    p.add_argument("--transfer-timeout", type=int, default=None, help="MC_TRANSFER_TIMEOUT, seconds (>= 5)")
    p.add_argument("--queue-size", type=int, default=None, help="SGLANG_DISAGGREGATION_QUEUE_SIZE")
    args = p.parse_args(argv)
    real.main(argv, target_class=MooncakeTarget, args=args)


if __name__ == "__main__":
    main(sys.argv[1:])
