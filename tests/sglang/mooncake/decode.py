#!/usr/bin/env python3
"""One decode rank for tests/sglang/mooncake/prefill.py (read its docstring):
a real process running SGLang 0.5.23's MooncakeKVManager in DECODE mode and
one MooncakeKVReceiver per room, over the process's shared Mooncake
TransferEngine (mooncake-transfer-engine-non-cuda 0.3.13.post1, TCP on
loopback, P2PHANDSHAKE metadata). The room loop is the NIXL decode's
(tests/sglang/real/decode.py serve(): DecodePreallocQueue /
DecodeTransferQueue driving CommonKVReceivers); only the set-up differs.
Same stdin commands and stdout events; decode_ready also carries the
engine's session ("ip:rpc_port", what the prefill's openSegment is given).
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../real"))
import common  # noqa: E402
import decode as real_decode  # noqa: E402
from common import emit  # noqa: E402


def init_engine():
    """What the scheduler process does before it builds its KV manager
    (maybe_init_shared_mooncake_transfer_engine, from the model runner's
    set-up): one TransferEngine per process, initialised with
    (get_local_ip_auto(), "P2PHANDSHAKE", MOONCAKE_PROTOCOL, ib device).
    SGLANG_HOST_IP=127.0.0.1 and MOONCAKE_PROTOCOL=tcp (set by the prefill
    target) make it TCP on loopback."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_mooncake_transfer_engine,
        maybe_init_shared_mooncake_transfer_engine,
    )

    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    engine = get_mooncake_transfer_engine()
    if engine is None:
        raise SystemExit("SGLang made no Mooncake TransferEngine: is the transfer backend 'mooncake'?")
    return engine


def loaded_engine_so():
    """The mooncake/engine.so this process mapped, from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[-1].endswith("/mooncake/engine.so"):
                return fields[-1]
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap-port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--mla", action="store_true")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--aux-slots", type=int, default=64)
    p.add_argument("--max-seconds", type=float, default=300.0)
    args = p.parse_args()
    common.claim_stdout()
    deadline = time.monotonic() + args.max_seconds
    import numpy as np

    common.publish_server_args("decode", args.tp_size, args.tp_rank, args.bootstrap_port, backend="mooncake")
    engine = init_engine()
    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_server_args

    pools = common.HostPools(np, layers=args.layers, mla=args.mla, pages=args.pages, page_bytes=args.page_bytes,
                             aux_slots=args.aux_slots)
    kv_args = pools.kv_args(KVArgs, engine_rank=args.tp_rank, page_size=args.page_size, mla=args.mla, kv_head_num=1,
                            total_kv_head_num=2)
    mgr = MooncakeKVManager(kv_args, DisaggregationMode.DECODE, get_server_args(), args.mla)
    addr = f"127.0.0.1:{args.bootstrap_port}"
    emit("decode_ready", pid=os.getpid(), port=mgr.rank_port, session=engine.get_session_id(), tp_rank=args.tp_rank,
         tp_size=args.tp_size, mla=args.mla, engine_so=loaded_engine_so())
    real_decode.serve(mgr, MooncakeKVReceiver, KVPoll, pools, np, addr, deadline)
    os._exit(0)


if __name__ == "__main__":
    main()
