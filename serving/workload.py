"""Requests, and the random workload of SGLang's bench_serving (`--dataset-name=random`).

    random_requests(num_prompts=16, input_len=256, output_len=32, range_ratio=0.5,
                    vocab_size=512, seed=0)

Lengths follow bench_serving's random dataset: input lengths uniform in
[max(1, input_len * range_ratio), input_len], output lengths uniform in
[max(1, output_len * range_ratio), output_len], both inclusive. Prompt tokens are uniform over
the vocabulary (only their count matters to a random-weight model).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: a prompt and how many tokens to produce at most."""

    id: int
    prompt: np.ndarray  # i32[T]: prompt token ids
    max_new_tokens: int  # generation stops after this many tokens (the first comes from prefill)
    eos_token_id: int | None = None  # generation also stops after this token; None: never
    # PD disaggregation (serving.disaggregation): KV a prefill instance computed
    # (models.dsa.runner.PrefilledKV) and the first token it sampled; the decode side admits it as is.
    prefilled: object | None = None
    first_token: int | None = None

    def __post_init__(self):
        if isinstance(self.id, bool) or not isinstance(self.id, (int, np.integer)) or self.id < 0:
            raise UsageError(f"request id must be a non-negative integer, got {self.id!r}")
        if self.prompt.ndim != 1 or self.prompt.shape[0] < 1:
            raise UsageError(f"request {self.id}: prompt must be a non-empty 1-D token array, got shape {self.prompt.shape}")
        if self.max_new_tokens < 1:
            raise UsageError(f"request {self.id}: max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def max_tokens(self) -> int:
        """Context the request may reach: what admission reserves for it."""
        return self.prompt_len + self.max_new_tokens


def _check_workload(num_prompts, input_len, output_len, range_ratio, vocab_size) -> None:
    for name, value in (("num_prompts", num_prompts), ("random_input_len", input_len),
                        ("random_output_len", output_len), ("vocab_size", vocab_size)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    if not 0.0 <= range_ratio <= 1.0:
        raise UsageError(f"random_range_ratio must be in [0, 1], got {range_ratio}")


def random_requests(
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    eos_token_id: int | None = None,
) -> list[Request]:
    """`num_prompts` requests with bench_serving's random lengths; the same seed, the same workload."""
    _check_workload(num_prompts, input_len, output_len, range_ratio, vocab_size)
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(max(1, int(input_len * range_ratio)), input_len + 1, size=num_prompts)
    output_lens = rng.integers(max(1, int(output_len * range_ratio)), output_len + 1, size=num_prompts)
    return [
        Request(i, rng.integers(0, vocab_size, size=int(t)).astype(np.int32), int(n), eos_token_id)
        for i, (t, n) in enumerate(zip(input_lens, output_lens))
    ]
