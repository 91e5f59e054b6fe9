#!/usr/bin/env python3
"""vLLM 0.33.0's NixlConnector (pull mode, the default) as a test target: a
prefill engine and a decode engine (tests/vllm/engine.py, each its own
process running vLLM's real NixlPullConnector scheduler and worker from the
wheel, unchanged, on CPU), and this process as the router between them, the
part vLLM's disaggregated proxy plays: it sends each request to the prefill,
takes the kv_transfer_params the prefill's request_finished returns and
hands them to the decode. What stands in for a server is listed in
engine.py's header.

The prefill's results reach the router as vLLM's frontend gets them: the
router binds a zmq PULL (vLLM's make_zmq_socket, ipc:// in a fresh temp
dir) before it starts the prefill, passes it as --output-path, and the
prefill's EngineCoreProc.process_output_sockets (vLLM's, unchanged)
connects a PUSH to it and sends each step's EngineCoreOutputs encoded by
MsgpackEncoder. A thread here decodes every message with vLLM's
MsgpackDecoder(EngineCoreOutputs), as the core client's output task does
(ENGINE_CORE_DEAD aside), emits one "output" line per EngineCoreOutput and
the router hands the decode that output's kv_transfer_params (not the
prefill's "finished" JSON line, which is only a log).

The flow, vLLM's own (pull_scheduler.py, pull_worker.py, base_worker.py):
- Prefill: request_finished holds the request's blocks (delay_free_blocks)
  and stamps a lease (kv_lease_duration, default 30 s) in _reqs_need_send;
  build_connector_meta hands it to the worker (_reqs_to_send). The prefill
  makes no transfer handle. Each step the worker's get_new_notifs (NIXL
  getNotifs) reads notifications: "<request id>:<consumers>" counts one
  consumer done, "HB:<id>,<id>..." extends the lease to now +
  kv_lease_duration*2/3. The blocks are freed (finished_sending) when every
  consumer has notified, or when the lease expires ("Releasing expired KV
  blocks for request ... before lease expired."). A notification for an id
  it does not hold logs "Potentially invalid KV blocks for unrecognized
  request ..." and is dropped.
- Decode: on_new_request starts heartbeats for the prefill's request id
  (every kv_lease_duration//6 s while it waits); once scheduled, the worker
  handshakes with the prefill's side channel (ZMQ, msgpack GET_META_MSG) in
  a background thread, add_remote_agent, then make_prepped_xfer("READ",
  local, remote, notif_msg=b"<prefill request id>:<consumers>") and
  transfer; each step check_xfer_state until DONE, then release.

Faults (--fault; request 0 always runs healthy first, so the decode has
handshaken with the prefill before a fault request; the fault applies to
requests 1..count-1):
- healthy: every request read and freed.
- never_read: the router never hands the request to the decode (decode
  never reads): the prefill frees it at lease expiry.
- mismatch: the router hands the decode a remote_request_id with a suffix
  (the id mismatch of vLLM PR 36958): the decode READs and notifies
  "<id>-x:1", the prefill logs it as unrecognized and holds the blocks to
  lease expiry.
- heartbeat: the decode admits the request (heartbeats start) but runs it
  only after --hold seconds (longer than the lease): the heartbeats keep
  extending the lease, the read succeeds and the prefill frees on its
  notification.
- read_hung: the router SIGSTOPs the prefill, the decode posts its READ,
  which hangs (UCX over TCP needs the target's progress) until the router
  SIGCONTs the prefill after --hold seconds.
- prefill_dies: as read_hung, but the router SIGKILLs the prefill once the
  decode has posted its READ.
- decode_abort: the decode admits the request and it is aborted before it
  runs (FINISHED_ABORTED): request_finished queues a notify-only receive,
  and the prefill frees on that notification without any READ.

stdout: JSON lines, those of both engines (with "role") and the router's
own ("ready" with both pids and agent names; "output" per EngineCoreOutput
decoded from the prefill's output socket, with request, finish_reason,
has_kv_transfer_params, engine_index and in_frame (outputs in that
message); "routed", "signal", "done").
The router waits for "go" on stdin after "ready".
"""
import argparse
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

FAULTS = ["healthy", "never_read", "mismatch", "heartbeat", "read_hung", "prefill_dies", "decode_abort"]
HERE = os.path.dirname(os.path.abspath(__file__))


_out_lock = threading.Lock()


def emit(event, **fields):
    write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


def write(line):
    with _out_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def free_ports(n):
    """`n` distinct free TCP ports for the engines' side channels and gloo
    stores, below the kernel's ephemeral range
    (net.ipv4.ip_local_port_range): a port bind(0) picks comes from that
    range, and any process's outgoing connection (an engine's ZMQ or gloo
    client, started meanwhile) could take it before the engine binds it
    (EADDRINUSE). Each is held bound until all are chosen, so none repeats."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    held = []
    try:
        while len(held) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", random.randrange(10000, ephemeral_low)))
            except OSError:
                s.close()
                continue
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


class Engine:
    """One engine process; its JSON lines go to `events` and are echoed."""

    def __init__(self, role, args, events, ports):
        self.role = role
        side_port, dist_port = ports
        cmd = [sys.executable, os.path.join(HERE, "engine.py"), "--role", role,
               "--engine-id", f"{role}-engine", "--side-port", str(side_port),
               "--dist-port", str(dist_port), "--lease", str(args.lease),
               "--model-dir", args.model_dir]
        if role == "prefill":
            cmd += ["--output-path", args.output_path]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.events = events
        threading.Thread(target=self.pump, daemon=True).start()

    def pump(self):
        for line in self.proc.stdout:
            write(line)
            try:
                value = json.loads(line)
            except ValueError:
                continue
            self.events.put(value)
        self.events.put({"event": "exited", "role": self.role, "code": self.proc.wait()})

    def send(self, **command):
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            emit("send_failed", role=self.role, command=command)


class Outputs:
    """The frontend's side of the prefill's output socket (core_client.py):
    a PULL that binds (make_zmq_socket), each multipart message decoded
    with MsgpackDecoder(EngineCoreOutputs), as its output-queue task does.
    Each EngineCoreOutput goes to `events` as an "output" event (with its
    kv_transfer_params, which the JSON line leaves out)."""

    def __init__(self, path, events):
        import zmq
        from vllm.utils.network_utils import make_zmq_socket

        self.path = path
        self.events = events
        self.ctx = zmq.Context()
        self.socket = make_zmq_socket(self.ctx, path, zmq.PULL)  # binds, before the prefill connects
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        from vllm.v1.engine import EngineCoreOutputs
        from vllm.v1.engine.core import EngineCoreProc
        from vllm.v1.serial_utils import MsgpackDecoder

        decoder = MsgpackDecoder(EngineCoreOutputs)
        while True:
            frames = self.socket.recv_multipart(copy=False)
            if len(frames) == 1 and frames[0].buffer == EngineCoreProc.ENGINE_CORE_DEAD:
                emit("engine_core_dead", role="prefill")
                continue
            outputs = decoder.decode(frames)
            for output in outputs.outputs:
                fields = dict(
                    request=output.request_id,
                    finish_reason=None if output.finish_reason is None else str(output.finish_reason),
                    has_kv_transfer_params=output.kv_transfer_params is not None,
                    engine_index=outputs.engine_index,
                    in_frame=len(outputs.outputs),
                )
                emit("output", **fields)
                self.events.put(dict(event="output", kv_transfer_params=output.kv_transfer_params, **fields))


class Router:
    def __init__(self, args):
        self.args = args
        self.events = queue.Queue()
        self.seen = []
        self.outputs = Outputs(args.output_path, self.events)
        ports = free_ports(4)
        self.prefill = Engine("prefill", args, self.events, ports[:2])
        self.decode = Engine("decode", args, self.events, ports[2:])

    def wait(self, match, within):
        """The first event (seen before or arriving within `within`) that
        matches; None on time-out."""
        for value in self.seen:
            if match(value):
                return value
        deadline = time.time() + within
        while time.time() < deadline:
            try:
                value = self.events.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                return None
            self.seen.append(value)
            if match(value):
                return value
        return None

    def need(self, what, match, within):
        value = self.wait(lambda v: match(v) or v.get("event") == "exited", within)
        if value is not None and value.get("event") == "exited" and not match(value):
            emit("error", message=f"router: the {value['role']} exited ({value['code']}) before {what}")
            raise SystemExit(2)
        if value is None:
            emit("error", message=f"router: no {what} within {within}s")
            raise SystemExit(2)
        return value

    def ready(self):
        ready = {}
        for role in ("prefill", "decode"):
            ready[role] = self.need(f"{role} ready", lambda v, r=role: v.get("event") == "ready" and v.get("role") == r, 180)
        return ready

    def prefill_one(self, request_id):
        self.prefill.send(cmd="prefill", request=request_id, prompt_len=self.args.prompt_len,
                          params={"do_remote_decode": True})
        output = self.need(f"EngineCoreOutput of {request_id} from the prefill on {self.args.output_path}",
                           lambda v: v.get("event") == "output" and v.get("request") == request_id, 60)
        if output["kv_transfer_params"] is None:
            emit("error", message=f"router: the prefill's EngineCoreOutput of {request_id} has no "
                 f"kv_transfer_params (finish_reason {output['finish_reason']})")
            raise SystemExit(2)
        return output["kv_transfer_params"]

    def signal(self, engine, sig):
        emit("signal", role=engine.role, signal=sig.name, pid=engine.proc.pid)
        os.kill(engine.proc.pid, sig)

    def run_request(self, index):
        args = self.args
        request_id = f"req-{index}"
        fault = args.fault if index > 0 else "healthy"
        params = self.prefill_one(request_id)
        emit("routed", request=request_id, fault=fault)
        if fault == "never_read":
            return
        if fault == "mismatch":
            params = dict(params, remote_request_id=params["remote_request_id"] + "-x")
        if fault in ("read_hung", "prefill_dies"):
            self.signal(self.prefill, signal.SIGSTOP)
        schedule = fault not in ("heartbeat", "decode_abort")
        self.decode.send(cmd="decode", request=request_id, prompt_len=args.prompt_len, params=params, schedule=schedule)
        if fault == "heartbeat":
            time.sleep(args.hold)
            self.decode.send(cmd="schedule", request=request_id)
        elif fault == "decode_abort":
            self.need(f"decode admitting {request_id}",
                      lambda v: v.get("event") == "admitted" and v.get("request") == request_id, 30)
            self.decode.send(cmd="abort", request=request_id)
        elif fault == "read_hung":
            self.need(f"decode READ of {request_id}",
                      lambda v: v.get("event") == "read_posted" and v.get("request") == request_id, 30)
            time.sleep(args.hold)
            self.signal(self.prefill, signal.SIGCONT)
        elif fault == "prefill_dies":
            self.need(f"decode READ of {request_id}",
                      lambda v: v.get("event") == "read_posted" and v.get("request") == request_id, 30)
            time.sleep(args.hold)
            self.signal(self.prefill, signal.SIGKILL)

    def run(self):
        ready = self.ready()
        emit("ready", fault=self.args.fault, prefill_pid=ready["prefill"]["pid"], decode_pid=ready["decode"]["pid"],
             prefill_agent=ready["prefill"]["agent"], decode_agent=ready["decode"]["agent"],
             lease_s=self.args.lease, count=self.args.count)
        if sys.stdin.readline().strip() != "go":
            emit("error", message="router: expected `go` on stdin")
            raise SystemExit(2)
        # Request 0 healthy and done first: the decode has the prefill's agent.
        self.run_request(0)
        self.need("request 0 freed", lambda v: v.get("event") == "freed" and v.get("request") == "req-0", 60)
        for index in range(1, self.args.count):
            self.run_request(index)
            if self.args.fault in ("read_hung", "prefill_dies"):
                break  # one stopped prefill at a time
        emit("routed_all")
        # Until every request is settled (freed by the prefill, and received
        # by the decode where it was handed one), the decode exits, or
        # --max-seconds pass.
        count = self.args.count if self.args.fault not in ("read_hung", "prefill_dies") else 2
        reads = count if self.args.fault not in ("never_read", "decode_abort") else 1
        deadline = time.time() + self.args.max_seconds
        while time.time() < deadline:
            self.wait(lambda v: False, 0.2)
            freed = sum(1 for v in self.seen if v.get("event") == "freed")
            received = sum(1 for v in self.seen if v.get("event") == "received")
            decode_gone = any(v.get("event") == "exited" and v.get("role") == "decode" for v in self.seen)
            if (freed >= count and received >= reads) or decode_gone:
                break
        emit("done")

    def stop(self):
        for engine in (self.prefill, self.decode):
            if engine.proc.poll() is None:
                try:
                    os.kill(engine.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                engine.proc.kill()
                engine.proc.wait()


def main():
    p = argparse.ArgumentParser(description="vLLM NixlConnector prefill + decode, routed")
    p.add_argument("--fault", choices=FAULTS, default="healthy")
    p.add_argument("--count", type=int, default=3, help="requests, the first always healthy")
    p.add_argument("--lease", type=int, default=6, help="kv_lease_duration (s) of both engines")
    p.add_argument("--hold", type=float, default=8.0, help="heartbeat / read_hung / prefill_dies hold (s)")
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-seconds", type=float, default=30.0, help="how long to run after the last request")
    args = p.parse_args()
    # UCX over loopback TCP: a READ then needs the prefill's progress, so a
    # stopped prefill hangs it (shared-memory transports would not).
    os.environ.setdefault("UCX_TLS", "tcp,self")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    args.model_dir = tempfile.mkdtemp(prefix="stallwatch-vllm-model-")
    # The frontend's output address for the prefill (its PULL binds there).
    args.output_path = "ipc://" + os.path.join(tempfile.mkdtemp(prefix="stallwatch-vllm-pd-"), "output.ipc")
    # vLLM's imports (serial_utils, network_utils) on the CPU platform.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    router = Router(args)
    try:
        router.run()
    finally:
        router.stop()


if __name__ == "__main__":
    main()
