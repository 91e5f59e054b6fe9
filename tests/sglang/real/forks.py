"""The target's processes (SGLang's schedulers and detokenizer, the decode
ranks) forked from a server that imported torch and SGLang once, instead
of each a fresh interpreter that imports them again.

Every process of the target imports torch, transformers and SGLang's
server modules, about 15 s of CPU each (`python -X importtime`): with a
main process, a scheduler and two to four decodes, most of a test's
set-up on a 2-core host. multiprocessing's forkserver start method runs
one server process, started here as the main process starts (its imports
run beside the main process's own), that imports them once
(fork_server.py); each process is forked from it with them imported, and
imports its transfer backend's module itself. SGLang's own launcher uses
the spawn method: its processes differ from these only in how they came to
have the same modules imported. What each runs (SGLang's classes from the
wheel), the libraries it maps, its title, and the process tree below the
main process (the fork server is a child of it, every other process its)
are as they were.
"""

import multiprocessing
import os
import runpy
import signal
import sys
import threading
from multiprocessing import forkserver
from multiprocessing.connection import Connection

HERE = os.path.dirname(os.path.abspath(__file__))
# The modules every process imports.
PRELOAD = ["fork_server"]

_context = None


def context():
    """multiprocessing's forkserver context; the fork server is started on
    the first call (call it once the process's environment is set: the
    server and every process forked from it keep the one it started with)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        # Python 3.11's fork server imports its preload before it takes the
        # sys.path it is handed: this directory is on its PYTHONPATH, which
        # fork_server.py takes off again.
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *filter(None, [before])])
        try:
            forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
    return _context


def die_with_parent():
    """PR_SET_PDEATHSIG: SIGKILL when the parent (the fork server) exits."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


class Script:
    """`python SCRIPT ARGS...` forked from the fork server: its pid, stdin
    and stdout (text pipes) and exit code, as subprocess.Popen(cmd,
    stdin=PIPE, stdout=PIPE, text=True) gives them; its stderr is this
    process's. It dies with the fork server, which dies with this process."""

    def __init__(self, script, args):
        child_in, self_in = os.pipe()
        self_out, child_out = os.pipe()
        ends = (Connection(child_in, writable=False), Connection(child_out, readable=False))
        self._process = context().Process(target=_run_script, args=(script, list(args), *ends),
                                          name=os.path.basename(script))
        self._process.start()
        for end in ends:
            end.close()
        self.pid = self._process.pid
        self.stdin = os.fdopen(self_in, "w")
        self.stdout = os.fdopen(self_out, "r")
        # One reader of the fork server's exit status at a time (the decode
        # reader thread and a fault that kills the decode both wait).
        self._waiting = threading.Lock()

    def wait(self):
        with self._waiting:
            self._process.join()
        return self._process.exitcode


def _run_script(script, args, stdin, stdout):
    """In the forked process: the script's own start, as `python SCRIPT
    ARGS...` would run it, titled so."""
    die_with_parent()
    os.dup2(stdin.fileno(), 0)
    os.dup2(stdout.fileno(), 1)
    stdin.close()
    stdout.close()
    sys.stdin = os.fdopen(0, "r")
    argv = [script, *args]
    import setproctitle

    # The command line it would have had; the name (comm) kept, as an exec
    # of the same python gave it.
    name = setproctitle.getthreadtitle()
    setproctitle.setproctitle(" ".join([sys.executable, *argv]))
    setproctitle.setthreadtitle(name)
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")
