"""The one error type for bad user input to the serving engine (flags, workloads, budgets).

Library code raises UsageError with a message written for the user; run_decode.py catches it and
exits with status 2 and that one line, never a traceback.
"""


class UsageError(ValueError):
    """An invalid setting or request; the message names the value and the limit it breaks."""
