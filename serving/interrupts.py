"""Ctrl-C that always ends the run: one `interrupted` line and exit status 130.

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT arrives. Some
places swallow it: inside JAX's garbage-collection callback (jax._src.lib's _xla_gc_callback) it
is printed as "Exception ignored" with a traceback and the run goes on to the end, exiting 0. So
the handler records the request, the traceback of one swallowed there is not printed (install's
sys.unraisablehook), and a watchdog thread raises it again in the main thread every
RERAISE_EVERY_S seconds until the entry point says it has been handled. A repeat is dropped while
the main thread is handling the interrupt (an `except` block running cleanup, such as the
engine's abort that gives back slots and pages), so cleanup is never cut short by it.

    interrupts.install()
    try:
        ...                                  # the run
        interrupts.raise_if_requested()      # one swallowed at the very end
    except KeyboardInterrupt:
        interrupts.handled()
        print("interrupted", file=sys.stderr); sys.exit(130)
    finally:
        interrupts.handled()
"""

from __future__ import annotations

import signal
import sys
import threading

RERAISE_EVERY_S = 1.0

_requested = threading.Event()  # SIGINT arrived
_handled = threading.Event()  # the entry point caught it (or finished): raise no more
_watchdog: threading.Thread | None = None


def _on_sigint(signum, frame):
    if _handled.is_set():
        return
    if _requested.is_set() and isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return  # a repeat while the first is being handled: let its cleanup finish
    _requested.set()
    _start_watchdog()
    raise KeyboardInterrupt


def _start_watchdog() -> None:
    global _watchdog
    if _watchdog is None or not _watchdog.is_alive():
        _watchdog = threading.Thread(target=_reraise_until_handled, name="sigint-watchdog", daemon=True)
        _watchdog.start()


def _reraise_until_handled() -> None:
    while not _handled.wait(RERAISE_EVERY_S):
        # a real signal, not _thread.interrupt_main: that one does not wake a blocking call
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _quiet_unraisable(unraisable) -> None:
    """sys.unraisablehook: a KeyboardInterrupt swallowed in a callback (JAX's gc callback) prints
    nothing, as the watchdog raises it again; anything else goes to the hook before it."""
    if unraisable.exc_type is KeyboardInterrupt and _requested.is_set():
        return
    _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook


def install() -> None:
    """Route SIGINT through the recording handler (call from the main thread)."""
    global _previous_unraisablehook
    _requested.clear()
    _handled.clear()
    signal.signal(signal.SIGINT, _on_sigint)
    if sys.unraisablehook is not _quiet_unraisable:
        _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, _quiet_unraisable


def raise_if_requested() -> None:
    """KeyboardInterrupt if Ctrl-C arrived and was swallowed on its way."""
    if _requested.is_set() and not _handled.is_set():
        raise KeyboardInterrupt


def handled() -> None:
    """The entry point has dealt with Ctrl-C (or finished): the watchdog stops raising."""
    _handled.set()
