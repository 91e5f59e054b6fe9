"""Python wrapper of libstallwatch_marker.so (ctypes, no other dependency).

    from stallwatch_marker import Marker
    marker = Marker()                    # $STALLWATCH_MARKER_LIB, else the loader's search path
    marker.enqueued(room)                # the request entered the queue
    marker.mark(room, Marker.ABORTED)    # or any stage by its code

Each call is one C call of a function that does nothing; with stallwatch's
built-in `marker` profile attached, each becomes a lifecycle event of the
request `room` (its key, and its external id in decimal).
"""

import ctypes
import os


class Marker:
    """Stage codes are stallwatch's: the order of its lifecycle stages."""

    ENQUEUED = 0
    TRANSFER_POSTED = 1
    TRANSFER_DONE = 2
    RELEASED = 3
    ABORTED = 4
    FAILED = 5

    def __init__(self, path=None):
        path = path or os.environ.get("STALLWATCH_MARKER_LIB") or "libstallwatch_marker.so"
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise OSError(f"cannot load the stallwatch marker library {path!r}: {e}; "
                          "build it with `cargo build --release -p stallwatch-marker` and pass its path "
                          "(or set STALLWATCH_MARKER_LIB)") from e
        self._mark = self._lib.stallwatch_mark
        self._mark.argtypes = (ctypes.c_uint64, ctypes.c_uint32)
        self._mark.restype = ctypes.c_int

    def mark(self, room, event):
        if self._mark(room, event) != 0:
            raise ValueError(f"unknown stallwatch marker event {event} (0 to 5)")

    def enqueued(self, room):
        self._mark(room, self.ENQUEUED)

    def transfer_posted(self, room):
        self._mark(room, self.TRANSFER_POSTED)

    def transfer_done(self, room):
        self._mark(room, self.TRANSFER_DONE)

    def released(self, room):
        self._mark(room, self.RELEASED)

    def aborted(self, room):
        self._mark(room, self.ABORTED)

    def failed(self, room):
        self._mark(room, self.FAILED)
