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
from collections.abc import Callable, Iterator
from typing import TextIO

from prefixcache.entrypoints.cli import discard_stdout

TraceWriter = Callable[[TextIO], None]

# Bytes of an output's name kept in its temporary file's name, which adds 18 more: a name
# may have at most 255.
_MAX_STEM_BYTES = 200


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
    # A long name is cut for the temporary one, at most 4 bytes a character.
    stem = name if len(os.fsencode(name)) <= _MAX_STEM_BYTES else name[:_MAX_STEM_BYTES // 4]
    with contextlib.ExitStack() as stack:
        try:
            fd, temporary = stack.enter_context(_temporary_file(directory, f".{stem}."))
        except OSError as exc:
            if not (status is not None and _refused_by_directory(exc)
                    and os.access(path, os.W_OK)):
                raise
            with open(path, "w", encoding="utf-8") as handle:
                write(handle)
            return
        try:
            with open(fd, "w", encoding="utf-8") as handle:
                if status is not None:
                    mode = stat.S_IMODE(status.st_mode)
                else:  # mkstemp's file is private (0600); open() would apply the umask
                    umask = os.umask(0)
                    os.umask(umask)
                    mode = 0o666 & ~umask
                with contextlib.suppress(OSError):  # a file system without modes
                    os.fchmod(handle.fileno(), mode)
                write(handle)
            os.replace(temporary, path)
        except BaseException:  # a Ctrl-C too: never leave a partial trace behind
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


# Signals that end a process by default and that a user or a supervisor sends to stop a
# command (``timeout``, a closed terminal).
_TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                             if hasattr(signal, name))


@contextlib.contextmanager
def _temporary_file(directory: str, prefix: str) -> Iterator[tuple[int, str]]:
    """A new file ``directory/prefix*.partial``, as ``(fd, path)``, that no terminating
    signal leaves behind: while inside, each of :data:`_TERMINATING_SIGNALS` whose handler
    is the default (not ignored, as under ``nohup``, nor handled) first removes the file if
    it is still there, then ends the process by that signal, as it would have. The
    signals are held off while the file is made and while the default handlers are put
    back, so that none finds the file unnamed or is lost. OSError if the file cannot be
    made. Only the main thread can set handlers: elsewhere (and where signals cannot be
    held off) the file is made and nothing else changes."""
    if (threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "pthread_sigmask")):
        yield tempfile.mkstemp(prefix=prefix, suffix=".partial", dir=directory)
        return
    made: list[str] = []

    def remove_then_end(signum, frame):
        for path in made:
            with contextlib.suppress(OSError):
                os.unlink(path)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    signals = [signum for signum in _TERMINATING_SIGNALS
               if signal.getsignal(signum) is signal.SIG_DFL]
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        fd, temporary = tempfile.mkstemp(prefix=prefix, suffix=".partial", dir=directory)
        made.append(temporary)
        for signum in signals:
            signal.signal(signum, remove_then_end)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    try:
        yield fd, temporary
    finally:
        # Holding the signals off runs any handler already due first (Python runs them
        # once the call returns); one that comes later waits for the default handler.
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        for signum in signals:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def _refused_by_directory(exc: OSError) -> bool:
    """Whether creating a file failed because the directory does not allow it."""
    return isinstance(exc, PermissionError) or exc.errno == errno.EROFS


def _stdout_error(command: str, reason: str) -> int:
    print(f"prefixcache {command}: error: cannot write standard output: {reason}",
          file=sys.stderr)
    return 1
