"""Where a command that makes a trace (``prefixcache synth``, ``prefixcache merge``) writes
it: a file, replaced only once the trace is whole, or standard output.

Both take ``write(handle)``, which writes the whole trace to a text handle, so a trace can
be written line by line as it is made and is never held in memory whole on this side.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import TextIO

from prefixcache.entrypoints.cli import discard_stdout

TraceWriter = Callable[[TextIO], None]


def write_to_stdout(write: TraceWriter, command: str) -> int:
    """Write the trace to standard output: 0, or 1 with a one-line error naming
    ``command`` if it cannot be written (closed, or a write fails). A reader that went
    away (BrokenPipeError) is left to the ``prefixcache`` entry point, which exits 141
    quietly."""
    if sys.stdout is None:  # started with stdout closed (``>&-``)
        return _stdout_error(command, "it is closed")
    try:
        write(sys.stdout)
        sys.stdout.flush()  # so that a failing final write is reported here
    except BrokenPipeError:
        raise
    except OSError as exc:
        discard_stdout()
        return _stdout_error(command, exc.strerror or str(exc))
    return 0


def write_to_file(path: str, write: TraceWriter) -> None:
    """Write the trace to ``path``. OSError if it cannot be written.

    An output that exists and is not a regular file (a device, a FIFO, ``/dev/stdout``,
    a process substitution's ``/dev/fd/N``) is opened by its name and written directly:
    there is nothing to replace. A regular file (or a new one) is replaced only once the
    trace is complete: the trace is written to a temporary file in the same directory,
    which is renamed over the output at the end and removed on any error or interrupt
    (Ctrl-C, or SIGTERM or SIGHUP where they would have ended the process: it is then
    ended by that signal, as it would have been, once the file is removed).
    A file that existed keeps its permission bits; a new one gets the mode ``open()``
    would give it. If the directory does not let the temporary file be created but the
    existing file is writable, the trace is written into that file directly: it is then
    not replaced atomically, and an error or interrupt leaves it partly written."""
    try:
        status = os.stat(path)  # of what a symbolic link names
    except FileNotFoundError:
        status = None
    if status is not None and not stat.S_ISREG(status.st_mode):
        # By the name as given: resolving /dev/stdout when it is a pipe gives
        # /proc/<pid>/fd/pipe:[N], which cannot be opened.
        with open(path, "w", encoding="utf-8") as handle:
            write(handle)
        return
    # Through a symbolic link to the file it names: renaming over the link itself would
    # replace the link with a regular file.
    path = os.path.realpath(path)
    directory, name = os.path.split(path)
    # The temporary name adds 18 bytes to the output's: cut a long one (a name may have
    # at most 255 bytes), at most 4 bytes a character.
    stem = name if len(os.fsencode(name)) <= _MAX_STEM_BYTES else name[:_MAX_STEM_BYTES // 4]
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{stem}.", suffix=".partial",
                                         dir=directory)
    except OSError as exc:
        if not (status is not None and _refused_by_directory(exc)
                and os.access(path, os.W_OK)):
            raise
        with open(path, "w", encoding="utf-8") as handle:
            write(handle)
        return
    try:
        with _termination_raises(), open(fd, "w", encoding="utf-8") as handle:
            if status is not None:
                mode = stat.S_IMODE(status.st_mode)
            else:  # mkstemp's file is private (0600); open() would have applied the umask
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
            with contextlib.suppress(OSError):  # a file system without modes
                os.fchmod(handle.fileno(), mode)
            write(handle)
            handle.close()
            os.replace(temporary, path)
    except BaseException as exc:  # a Ctrl-C too: never leave a partial trace behind
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(exc, _Terminated):  # its own handler is back: end as it would have
            os.kill(os.getpid(), exc.signum)
        raise


_MAX_STEM_BYTES = 200
# Signals that end a process by default and that a user or a supervisor sends to stop a
# command (``timeout``, a closed terminal).
_TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                             if hasattr(signal, name))


class _Terminated(BaseException):
    """A terminating signal arrived while a trace was being written."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _termination_raises():
    """While inside: each of :data:`_TERMINATING_SIGNALS` that would end the process (its
    handler is the default) raises :class:`_Terminated` instead, so that cleanup runs;
    the handlers are put back on the way out. Only the main thread can set handlers:
    elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise _Terminated(signum)

    replaced = {signum: signal.signal(signum, raise_terminated)
                for signum in _TERMINATING_SIGNALS
                if signal.getsignal(signum) is signal.SIG_DFL}
    try:
        yield
    finally:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)


def _refused_by_directory(exc: OSError) -> bool:
    """Whether creating a file failed because the directory does not allow it."""
    return isinstance(exc, PermissionError) or exc.errno == errno.EROFS


def _stdout_error(command: str, reason: str) -> int:
    print(f"prefixcache {command}: error: cannot write standard output: {reason}",
          file=sys.stderr)
    return 1
