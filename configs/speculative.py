"""Speculative decoding settings, SGLang's flags: EAGLE chain drafting with the model's MTP layer.

    SpeculativeConfig(num_steps=3)                     # --speculative_algorithm=EAGLE
                                                       # --speculative_num_steps=3
                                                       # --speculative_eagle_topk=1
                                                       # --speculative_num_draft_tokens=4

Each decode step verifies num_draft_tokens = num_steps + 1 tokens per request (the last accepted
token's successor and num_steps drafted ones) in one target forward and keeps the longest prefix
the target's greedy choice agrees with, plus the target's own next token (models.dsa.speculative).
Only a chain (eagle_topk 1) is built: SGLang's tree drafting (topk > 1) is refused.
"""

from __future__ import annotations

import dataclasses

SPECULATIVE_ALGORITHMS = ("EAGLE",)  # SGLang's name for MTP drafting of DeepSeek-V3.x / GLM-5.x


class SpeculativeConfigError(ValueError):
    """A speculative-decoding setting is not supported; the message is one line naming it."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    num_steps: int = 3  # draft steps per verification (tokens the MTP layer proposes)
    eagle_topk: int = 1  # draft branches per step: 1, a chain
    num_draft_tokens: int | None = None  # tokens verified per step; None: num_steps + 1 (the only value with topk 1)
    algorithm: str = "EAGLE"

    def __post_init__(self):
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise SpeculativeConfigError(f"speculative_algorithm {self.algorithm!r} is not supported; use one of {SPECULATIVE_ALGORITHMS}")
        for name in ("num_steps", "eagle_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpeculativeConfigError(f"speculative_{name}={value!r} must be a positive integer")
        if self.eagle_topk != 1:
            raise SpeculativeConfigError(f"speculative_eagle_topk={self.eagle_topk} is not supported: only 1 (chain drafting, no tree)")
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", self.num_steps + 1)
        if self.num_draft_tokens != self.num_steps + 1:
            raise SpeculativeConfigError(
                f"speculative_num_draft_tokens={self.num_draft_tokens!r} must be speculative_num_steps + 1"
                f" ({self.num_steps + 1}) with speculative_eagle_topk=1"
            )

    @property
    def tokens_per_step(self) -> int:
        """Q: tokens verified per request and step (num_draft_tokens)."""
        return self.num_draft_tokens
