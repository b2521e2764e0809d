"""The one place that knows how an MLA KV row is stored (device buffer, host pool, full KV).

An absorbed-MLA KV row of one token in one layer is its compressed latent (kv_lora_rank values,
512 in DeepSeek-V3.2 / GLM-5.x, after kv_a_layernorm) followed by its rotated rope key
(qk_rope_head_dim values, 64). Attention keys are the whole row; values are the latent part.

Layouts:
  "bfloat16": bf16[latent + rope] = 576 x 2 B = 1152 B per row (FlashMLA's sparse bf16 layout).
  "float32":  f32[latent + rope], for exact tests against float32 references.
The FP8 layout (FlashMLA's 656 B: 512 fp8_e4m3 + 4 f32 scales + 64 bf16 rope) is a packing of
the same two parts; it belongs here when added, as a `pack`/`unpack` pair. Copy kernels move
rows as opaque `width`-wide arrays and never need to know which layout they carry.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_PLAIN_LAYOUTS = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class KVRowLayout:
    """How one token's MLA KV row of one layer is stored: row[W] of `dtype`, W = latent + rope."""

    latent_dim: int  # kv_lora_rank: the value part of each row
    rope_dim: int  # qk_rope_head_dim: the rotated key part after the latent
    kind: str = "bfloat16"

    def __post_init__(self):
        if self.kind not in _PLAIN_LAYOUTS:
            raise ValueError(
                f"KVRowLayout kind {self.kind!r} is not supported; use one of {sorted(_PLAIN_LAYOUTS)}"
            )
        for name in ("latent_dim", "rope_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVRowLayout {name} must be positive, got {getattr(self, name)}")

    @property
    def dtype(self) -> np.dtype:
        """Element type of a stored row."""
        return np.dtype(_PLAIN_LAYOUTS[self.kind])

    @property
    def width(self) -> int:
        """Elements per stored row."""
        return self.latent_dim + self.rope_dim

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one stored row (width x element size)."""
        return self.width * self.dtype.itemsize

    def pack(self, latent: jax.Array, rope: jax.Array) -> jax.Array:
        """latent [..., latent_dim], rope [..., rope_dim] (any float dtype) -> row[..., width] in `dtype`."""
        return jnp.concatenate([latent, rope], axis=-1).astype(self.dtype)

    def unpack(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        """row[..., width] -> (f32[..., latent_dim], f32[..., rope_dim])."""
        rows = rows.astype(jnp.float32)
        return rows[..., : self.latent_dim], rows[..., self.latent_dim :]

    @classmethod
    def for_dtype(cls, latent_dim: int, rope_dim: int, dtype) -> "KVRowLayout":
        """The plain layout holding rows in `dtype` (bfloat16 or float32)."""
        name = np.dtype(dtype).name
        if name not in _PLAIN_LAYOUTS:
            raise ValueError(f"no KV row layout stores {name}; use bfloat16 or float32")
        return cls(latent_dim, rope_dim, name)
