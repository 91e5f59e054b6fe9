#!/usr/bin/env python3
"""vLLM's KV path as NIXL sees it, for the `vllm` bench (agent/benches/vllm.rs):
not vLLM's classes (tests/vllm/pd.py runs those), but the same NIXL calls in
the same shape, as fast as they go, so what watching them costs shows.

- decode (this process, the initiator): per request, as vLLM's
  NixlPullConnectorWorker does (`_read_blocks` -> `make_prepped_xfer`,
  `transfer`, `check_xfer_state` until DONE, `release_xfer_handle`): a READ
  of one block on prepped dlists with the notification
  "<request id>:1", posted, polled, released; every --heartbeat-every
  requests a genNotif heartbeat "HB:<id>,<id>,...".
- prefill (a child process): NIXL getNotifs in a loop, as vLLM's worker
  polls it every engine step (`get_new_notifs`), timing every call: the
  empty ones (most) and those that return notifications, each of which the
  `vllm` profile's kernel walk reads. Each step it also sends one
  EngineCoreOutputs-shaped frame (msgpack `[0, [output x4], None, timestamp, None x5]`, four
  outputs of one token with kv_transfer_params and no finish_reason, about
  1.3 KB: nothing held) with pyzmq as vLLM's output thread does
  (`send(copy=False, track=True)` on a PUSH socket), timing the send: the
  `vllm_outputs` capture reads every such frame whole.

stdout: JSON lines: "ready" (both pids), then after "go" on stdin, "done"
with the decode's transfers/s and the prefill's time per getNotifs call.
"""
import argparse
import json
import os
import select
import struct
import subprocess
import sys
import tempfile
import time


def emit(event, **fields):
    print(json.dumps(dict(event=event, **fields)), flush=True)


def make_agent(name):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False))


def msgpack(value):
    """The msgpack of None, bool, int >= 0, float, str, list and dict, as
    msgspec writes them (no msgpack library in this venv)."""
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if value is None:
        return b"\xc0"
    if isinstance(value, bool):
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        return bytes([value]) if value < 128 else b"\xcd" + value.to_bytes(2, "big")
    if isinstance(value, str):
        data = value.encode()
        return (bytes([0xa0 | len(data)]) if len(data) < 32 else b"\xd9" + bytes([len(data)])) + data
    if isinstance(value, list):
        head = bytes([0x90 | len(value)]) if len(value) < 16 else b"\xdc" + len(value).to_bytes(2, "big")
        return head + b"".join(msgpack(v) for v in value)
    if isinstance(value, dict):
        return bytes([0x80 | len(value)]) + b"".join(msgpack(k) + msgpack(v) for k, v in value.items())
    raise TypeError(value)


def engine_outputs(n):
    """An EngineCoreOutputs of `n` streaming outputs (vllm 0.33.0's field
    order, all 19 fields of each, as msgspec writes them), none finished."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
              "remote_engine_id": "0f0e0d0c-0b0a-0908-0706-050403020100", "remote_request_id": "",
              "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "transfer_mode": "pull"}
    outputs = []
    for k in range(n):
        request_id = f"cmpl-bench-{k:032d}-0"
        output = [request_id, [300 + k], None, None, None, None, None, None, dict(params, remote_request_id=request_id)]
        outputs.append(output + [None] * 4 + [0] + [None] * 5)
    return msgpack([0, outputs, None, time.monotonic()] + [None] * 5)


def prefill(args):
    import numpy as np
    import zmq

    buf = np.full(args.size * args.slots, 7, dtype=np.uint8)
    agent = make_agent("bench-prefill")
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    with open(os.path.join(args.workdir, "prefill.md"), "wb") as f:
        f.write(agent.get_agent_metadata())
    emit("meta", addr=buf.ctypes.data, pid=os.getpid())
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    address = "ipc://" + os.path.join(args.workdir, "outputs.ipc")
    sink.bind(address)
    out = ctx.socket(zmq.PUSH)
    out.connect(address)
    frame = bytearray(engine_outputs(4))
    calls = empty = notifs = sends = 0
    empty_ns = busy_ns = send_ns = 0
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0)
        if readable:
            break
        t0 = time.perf_counter_ns()
        got = agent.get_new_notifs()
        dt = time.perf_counter_ns() - t0
        calls += 1
        n = sum(len(v) for v in got.values())
        if n:
            notifs += n
            busy_ns += dt
        else:
            empty += 1
            empty_ns += dt
        t0 = time.perf_counter_ns()
        out.send(frame, 0, copy=False, track=True)
        send_ns += time.perf_counter_ns() - t0
        sends += 1
        sink.recv(copy=False)
        if args.step:
            time.sleep(args.step)
    emit("prefill", calls=calls, empty=empty, notifs=notifs,
         empty_ns_per_call=empty_ns / max(empty, 1), busy_ns_per_call=busy_ns / max(calls - empty, 1),
         output_bytes=len(frame), send_ns_per_output=send_ns / max(sends, 1))


def next_event(stream, event):
    """The next JSON line of `event` (NIXL may print lines of its own)."""
    for line in stream:
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and value.get("event") == event:
            return value
    raise SystemExit(f"the prefill exited before `{event}`")


def decode(args):
    import numpy as np

    workdir = tempfile.mkdtemp(prefix="stallwatch-vllm-bench-")
    child = subprocess.Popen([sys.executable, __file__, "--role", "prefill", "--workdir", workdir,
                              "--size", str(args.size), "--slots", str(args.slots), "--step", str(args.step)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    meta = next_event(child.stdout, "meta")
    buf = np.zeros(args.size * args.slots, dtype=np.uint8)
    agent = make_agent("bench-decode")
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    with open(os.path.join(workdir, "prefill.md"), "rb") as f:
        remote = agent.add_remote_agent(f.read())
    blocks = [(buf.ctypes.data + i * args.size, args.size, 0) for i in range(args.slots)]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks, "DRAM")
    far = [(meta["addr"] + i * args.size, args.size, 0) for i in range(args.slots)]
    remote_side = agent.prep_xfer_dlist(remote, far, "DRAM")

    def read(n):
        slot = [n % args.slots]
        h = agent.make_prepped_xfer("READ", local, slot, remote_side, slot, notif_msg=f"req-{n}:1".encode())
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
        if state != "DONE":
            raise SystemExit(f"READ {n}: {state}")

    # The connection, set up before anything is timed.
    for n in range(3):
        read(n)
    emit("ready", decode_pid=os.getpid(), prefill_pid=meta["pid"])
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("expected `go`")
    t0 = time.perf_counter()
    for n in range(args.count):
        read(n)
        if args.heartbeat_every and n % args.heartbeat_every == 0:
            agent.send_notif(remote, ("HB:" + ",".join(f"req-{n + k}" for k in range(3))).encode())
    elapsed = time.perf_counter() - t0
    time.sleep(0.3)  # the last notifications read
    child.stdin.write("quit\n")
    child.stdin.flush()
    stats = next_event(child.stdout, "prefill")
    child.wait()
    emit("done", transfers_per_s=args.count / elapsed, gb_per_s=args.count * args.size / elapsed / 1e9,
         prefill=stats)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("decode", "prefill"), default="decode")
    p.add_argument("--size", type=int, default=4096, help="bytes per READ")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--heartbeat-every", type=int, default=100, help="a heartbeat every N requests (0: none)")
    p.add_argument("--step", type=float, default=0.0005,
                   help="prefill: seconds between getNotifs calls, as an engine step (default 0.0005)")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if args.role == "prefill":
        prefill(args)
    else:
        decode(args)


if __name__ == "__main__":
    main()
