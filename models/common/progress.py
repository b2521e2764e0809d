"""Progress of checkpoint decoding at INFO (Python logging; run_decode.py shows it through absl):
what is being done, and how far the decode loop is, so a long decode is not silent.

    log = DecodeProgress(steps=16, label="deepseek_v4")
    log.prefill(batch=2, prompt_len=96)            # before the prompts' forward
    ...; log.prefilled()                           # after it (compiling included)
    for j in range(1, 16): ...; log.step(j, wait_for=token)

Decode steps are logged at the first and the last one and otherwise at most once per
`interval_s`, so a thousand-token decode writes a line a second, not a thousand. A logged step
first waits for `wait_for` (its tokens) so the count is of steps done, not dispatched; steps not
logged are not waited for.
"""

from __future__ import annotations

import logging
import time

import jax

logger = logging.getLogger("hisparse_jax.decode")


class DecodeProgress:
    def __init__(self, steps: int, label: str = "", *, interval_s: float = 1.0):
        self.steps, self.label, self.interval_s = steps, f"{label}: " if label else "", interval_s
        self._start = self._last = time.perf_counter()

    def _since_start(self) -> float:
        return time.perf_counter() - self._start

    def prefill(self, batch: int, prompt_len: int) -> None:
        logger.info("%sprefill: %d prompt(s) of %d tokens (the first run compiles)", self.label, batch, prompt_len)
        self._start = time.perf_counter()

    def prefilled(self, wait_for=None) -> None:
        if wait_for is not None:
            jax.block_until_ready(wait_for)
        logger.info("%sprefill done in %.1f s; decoding %d more token(s) per prompt", self.label, self._since_start(), self.steps)
        self._start = self._last = time.perf_counter()

    def step(self, done: int, wait_for=None) -> None:
        """`done` decode steps of `steps` have been dispatched; logs when one is due."""
        now = time.perf_counter()
        if done not in (1, self.steps) and now - self._last < self.interval_s:
            return
        if wait_for is not None:
            jax.block_until_ready(wait_for)
        self._last = time.perf_counter()
        logger.info("%sdecode step %d/%d (%.1f s)", self.label, done, self.steps, self._last - self._start)


def load_logged(checkpoint, load):
    """load() (a family's checkpoint loader) between two INFO lines: where from, then how many
    params and bytes, and how long it took."""
    from flax import nnx

    logger.info("loading weights from %s", checkpoint)
    start = time.perf_counter()
    model = load()
    leaves = jax.tree.leaves(nnx.state(model))
    count, size = sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)
    logger.info("loaded %.3g params (%s) in %.1f s", count, bytes_text(size), time.perf_counter() - start)
    return model


def bytes_text(size: float) -> str:
    """1.3e12 -> '1.3 TB', 2.4e10 -> '24 GB', 855_000 -> '855 kB' (decimal units, 2-3 digits)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.2g} {unit}" if size < 10 * scale else f"{size / scale:.0f} {unit}"
    return f"{size:.0f} B"
