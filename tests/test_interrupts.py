"""serving.interrupts: a Ctrl-C swallowed on its way (as JAX's gc callback does) still ends the run."""

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def entry_point(run: str, before: str = "") -> str:
    """A script whose entry point handles Ctrl-C as serving.interrupts says (`interrupted`,
    status 130): `before` at top level, then `run` (indented 4) inside its try."""
    return f"""
import gc, sys, time
from serving import interrupts
interrupts.install()
{before}
try:
{run}
except KeyboardInterrupt:
    interrupts.handled()
    print("interrupted", flush=True)
    sys.exit(130)
finally:
    interrupts.handled()
"""

# The run swallows the first KeyboardInterrupt (as a gc callback would) and would then sleep for a
# minute and exit 0; the watchdog's second one must end it with the entry point's status 130.
SCRIPT = entry_point("""\
    try:
        print("ready", flush=True)  # inside the try that swallows: the signal may come at once
        time.sleep(30)
    except KeyboardInterrupt:
        print("swallowed", flush=True)
    time.sleep(30)
    interrupts.raise_if_requested()""") + 'print("finished", flush=True)\n'


def interrupt_once(script: str) -> tuple[int, str, str]:
    """Runs `script`, sends one SIGINT once it prints "ready" -> (exit status, stdout after
    "ready", stderr)."""
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, out, err


def test_a_swallowed_ctrl_c_is_raised_again_until_handled():
    status, out, err = interrupt_once(SCRIPT)
    assert status == 130, (out, err)
    assert out.split() == ["swallowed", "interrupted"], (out, err)


def test_without_ctrl_c_nothing_is_raised():
    script = "from serving import interrupts\ninterrupts.install()\ninterrupts.raise_if_requested()\ninterrupts.handled()\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# The run's cleanup (an except block, as the engine's abort) takes longer than the watchdog's
# period: a repeat must not cut it short.
CLEANUP = entry_point("""\
    try:
        print("ready", flush=True)
        time.sleep(30)
    except BaseException:
        time.sleep(2.5 * interrupts.RERAISE_EVERY_S)
        print("cleaned", flush=True)
        raise""")


def test_a_repeat_does_not_cut_cleanup_short():
    status, out, err = interrupt_once(CLEANUP)
    assert status == 130, err
    assert out.split() == ["cleaned", "interrupted"], (out, err)


# The Ctrl-C lands inside a gc callback (as in JAX's _xla_gc_callback): Python reports it as an
# "Exception ignored" with a traceback and goes on. The run must still end with status 130 and
# print no traceback.
IN_GC_CALLBACK = entry_point(
    before="""
def slow(phase, info):
    if phase == "start":
        try:
            if not slow.ready:  # the signal is sent while this callback sleeps
                slow.ready = print("ready", flush=True) or True
                time.sleep(10)
            time.sleep(0.2)
        except KeyboardInterrupt:
            print("in callback", flush=True)
            raise

slow.ready = False
gc.callbacks.append(slow)""",
    run="""\
    deadline = time.time() + 3
    while time.time() < deadline:
        gc.collect()
    interrupts.raise_if_requested()""",
)


def test_a_ctrl_c_swallowed_in_a_gc_callback_prints_no_traceback():
    status, out, err = interrupt_once(IN_GC_CALLBACK)
    assert status == 130 and out.split()[-1] == "interrupted", (out, err)
    assert "in callback" in out, (out, err)  # else the signal missed the callback: this test showed nothing
    assert "Traceback" not in err and "Exception ignored" not in err, err
