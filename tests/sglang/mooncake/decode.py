#!/usr/bin/env python3
"""One decode rank for tests/sglang/mooncake/prefill.py (read its docstring):
a real process running SGLang 0.5.23's MooncakeKVManager in DECODE mode and
one MooncakeKVReceiver per room, over the process's shared Mooncake
TransferEngine (mooncake-transfer-engine-non-cuda 0.3.13.post1, TCP on
loopback, P2PHANDSHAKE metadata). The room loop is the NIXL decode's
(tests/sglang/real/decode.py serve(): DecodePreallocQueue /
DecodeTransferQueue driving CommonKVReceivers), and so is the rest of the
rank (its main()); only the backend differs (MooncakeBackend). Same command
line but --nixl, same stdin commands and stdout events; decode_ready also
carries the engine's session ("ip:rpc_port", what the prefill's
openSegment is given).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../real"))
import decode as real_decode  # noqa: E402


class MooncakeBackend(real_decode.Backend):
    name = "mooncake"

    @staticmethod
    def add_args(p):
        pass

    def before_server_args(self, args):
        pass

    def classes(self):
        self.engine = init_engine()
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver

        return MooncakeKVManager, MooncakeKVReceiver

    def ready_fields(self, mgr):
        """The engine's session ("ip:rpc_port", what the prefill's
        openSegment is given) and the engine.so mapped."""
        return {"session": self.engine.get_session_id(), "engine_so": loaded_engine_so()}


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


if __name__ == "__main__":
    real_decode.main(MooncakeBackend())
