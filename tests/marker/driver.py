#!/usr/bin/env python3
"""A process that marks request stages with the stallwatch marker library
(common/marker) through its ctypes wrapper, for tests/e2e/marker.rs.

    python driver.py LIB    prints {"event":"ready","pid":P}, waits for "go"
                            on stdin, marks the rooms below, prints
                            {"event":"marked","rooms":{room: [stages]}}, and
                            holds until stdin EOF.

Each room's marks end at a different point: one complete request, one at
each stall point, one aborted, one failed. One room is the largest 63-bit
number (SGLang's rooms are random 63-bit integers).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../common/marker/python"))
from stallwatch_marker import Marker  # noqa: E402

ROOMS = {
    7001: ["enqueued", "transfer_posted", "transfer_done", "released"],
    2**63 - 1: ["enqueued"],
    7003: ["enqueued", "transfer_posted"],
    7004: ["enqueued", "transfer_posted", "transfer_done"],
    7005: ["enqueued", "aborted"],
    7006: ["enqueued", "transfer_posted", "failed"],
}


def say(event, **fields):
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def main():
    marker = Marker(sys.argv[1])
    say("ready", pid=os.getpid())
    if sys.stdin.readline().strip() != "go":
        return
    for room, stages in ROOMS.items():
        for stage in stages:
            getattr(marker, stage)(room)
    try:
        marker.mark(1, 6)
    except ValueError:
        pass
    else:
        raise SystemExit("an unknown event was accepted")
    say("marked", rooms={str(room): stages for room, stages in ROOMS.items()})
    sys.stdin.read()


if __name__ == "__main__":
    main()
