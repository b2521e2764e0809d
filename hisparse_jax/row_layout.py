"""The one place that knows how an MLA KV row is stored (device buffer, host pool, full KV).

An absorbed-MLA KV row of one token in one layer is its compressed latent (kv_lora_rank values,
512 in DeepSeek-V3.2 / GLM-5.x, after kv_a_layernorm) followed by its rotated rope key
(qk_rope_head_dim values, 64). Attention keys are the whole row; values are the latent part.

Layouts (`kind`):
  "bfloat16": bf16[latent + rope] = 576 x 2 B = 1152 B per row (FlashMLA's sparse bf16 layout).
  "float32":  f32[latent + rope], for exact tests against float32 references.
  "fp8_e4m3": FlashMLA's sparse FP8 row, 656 B for 512 + 64, held as uint32[164] words:
                words [0, D/4)            the latent quantised to fp8_e4m3, 4 per word;
                words [D/4, D/4 + D/G)    one float32 scale per group of G latent values;
                words [D/4 + D/G, W)      the rope part in bf16, 2 per word.
              Little-endian throughout: latent value 4w + j is byte j (bits 8j .. 8j + 7) of word
              w, rope value 2w + j is half j of its word, so the row's bytes are exactly
              FlashMLA's byte layout (512 fp8, 4 x f32, 64 x bf16). G = min(128, D): D must be a
              multiple of 128, or at most 128 (one group; the tiny test models have D = 32).
              Quantisation per group: scale = amax / 448 (fp8_e4m3's largest value; computed
              as amax x the f32 just below 1/448) rounded up to 21 significant bits, and
              q = fp8(x / scale), round to nearest even; an all-zero group stores scale 0 and
              zeros. The rounding (a relative change below 2^-20) makes 448 x scale exact in f32,
              so packing an unpacked row reproduces it bit for bit. Dequantised: q x scale.

Rows are one array dtype (`dtype`, `width` elements per row) so copy kernels move them as opaque
`width`-wide arrays and never need to know which layout they carry. `pack` builds the stored row
(quantising for fp8), `unpack` reads it back as float32; the attention kernel dequantises fp8
rows itself (pallas_kernels/sparse_mla_attention/).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import check_equal

_PLAIN_LAYOUTS = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
FP8 = "fp8_e4m3"
KINDS = (*_PLAIN_LAYOUTS, FP8)
KV_CACHE_DTYPES = ("auto", *KINDS)  # what for_kv_cache_dtype (and --kv_cache_dtype) accepts
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_GROUP = 128  # latent values per f32 scale (FlashMLA)
_SCALE_LOW_BITS = 3  # scales keep 21 significant bits: 448 = 7 x 2^6 times one is exact in f32
# amax / 448 as a product with the f32 just below 1/448: XLA turns a division by a constant into
# a product with f32(1/448) anyway, which is above 1/448 and would let a re-packed scale (from
# amax' = 448 x scale) round up past the stored one; one just below it makes re-packing exact.
_INV_FP8_MAX = np.nextafter(np.float32(1.0 / FP8_MAX), np.float32(0))


def _uint32_fill(fill_value) -> int:
    """The uint32 word an fp8 row array is filled with for `fill_value` (0 or NaN)."""
    if fill_value == 0:
        return 0
    if math.isnan(fill_value):
        return 0xFFFFFFFF  # decodes to NaN everywhere: fp8 0xFF, f32 0xFFFFFFFF, bf16 0xFFFF
    raise ValueError(f"fp8_e4m3 rows can be filled with 0 or NaN only, got {fill_value}")


@dataclasses.dataclass(frozen=True)
class KVRowLayout:
    """How one token's MLA KV row of one layer is stored: row[W] of `dtype` (see the module docstring)."""

    latent_dim: int  # kv_lora_rank: the value part of each row
    rope_dim: int  # qk_rope_head_dim: the rotated key part after the latent
    kind: str = "bfloat16"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"KVRowLayout kind {self.kind!r} is not supported; use one of {sorted(KINDS)}")
        for name in ("latent_dim", "rope_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVRowLayout {name} must be positive, got {getattr(self, name)}")
        if self.quantized:
            D, G = self.latent_dim, self.group_size
            if D % G or D % 4:
                raise ValueError(
                    f"fp8_e4m3 rows need latent_dim a multiple of {FP8_GROUP} (or at most {FP8_GROUP} and a"
                    f" multiple of 4): one f32 scale per {FP8_GROUP} latent values; got latent_dim {D}"
                )
            if self.rope_dim % 2:
                raise ValueError(f"fp8_e4m3 rows hold the rope part as bf16 pairs: rope_dim must be even, got {self.rope_dim}")

    # ---- what a row is ----------------------------------------------------------------------

    @property
    def quantized(self) -> bool:
        """Whether rows are fp8 with scales (the stored width then differs from logical_width)."""
        return self.kind == FP8

    @property
    def dtype(self) -> np.dtype:
        """Element type of a stored row (uint32 words for fp8_e4m3)."""
        return np.dtype(np.uint32) if self.quantized else np.dtype(_PLAIN_LAYOUTS[self.kind])

    @property
    def logical_width(self) -> int:
        """Values a row holds, latent + rope: the query width attention expects."""
        return self.latent_dim + self.rope_dim

    @property
    def width(self) -> int:
        """Elements per stored row: latent + rope, or for fp8 D/4 + D/G + rope/2 words (164 for 512 + 64)."""
        if self.quantized:
            return self.latent_dim // 4 + self.num_groups + self.rope_dim // 2
        return self.logical_width

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one stored row (width x element size): 1152 bf16, 656 fp8 for 512 + 64."""
        return self.width * self.dtype.itemsize

    @property
    def group_size(self) -> int:
        """fp8: latent values sharing one scale, min(128, latent_dim)."""
        return min(FP8_GROUP, self.latent_dim)

    @property
    def num_groups(self) -> int:
        """fp8: scales per row (latent_dim / group_size); 0 for plain layouts."""
        return self.latent_dim // self.group_size if self.quantized else 0

    @property
    def scale_offset(self) -> int:
        """fp8: first scale word (= latent_dim / 4)."""
        return self.latent_dim // 4

    @property
    def rope_offset(self) -> int:
        """fp8: first rope word (= latent_dim / 4 + num_groups)."""
        return self.scale_offset + self.num_groups

    def fill_element(self, fill_value):
        """The element a row array is filled with so that every value reads as `fill_value`
        (plain: itself; fp8: 0 or NaN only, as uint32 words)."""
        return _uint32_fill(fill_value) if self.quantized else fill_value

    # ---- building and reading rows ----------------------------------------------------------

    def pack(self, latent: jax.Array, rope: jax.Array) -> jax.Array:
        """latent [..., latent_dim], rope [..., rope_dim] (any float dtype) -> row[..., width] in `dtype`."""
        if not self.quantized:
            return jnp.concatenate([latent, rope], axis=-1).astype(self.dtype)
        lead, D, G = latent.shape[:-1], self.latent_dim, self.group_size
        x = latent.astype(jnp.float32).reshape(*lead, self.num_groups, G)
        scale = _round_up_scale(jnp.max(jnp.abs(x), axis=-1) * _INV_FP8_MAX)  # f32[..., groups]
        q = jnp.where(scale[..., None] > 0, x / jnp.where(scale > 0, scale, 1.0)[..., None], 0.0)
        q = jnp.clip(q, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).reshape(*lead, D // 4, 4)
        q = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint32)
        latent_words = q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)
        scale_words = jax.lax.bitcast_convert_type(scale, jnp.uint32)
        halves = jax.lax.bitcast_convert_type(rope.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
        halves = halves.reshape(*lead, self.rope_dim // 2, 2)
        rope_words = halves[..., 0] | (halves[..., 1] << 16)
        return jnp.concatenate([latent_words, scale_words, rope_words], axis=-1)

    def unpack(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        """row[..., width] -> (f32[..., latent_dim], f32[..., rope_dim]), dequantised for fp8."""
        if not self.quantized:
            rows = rows.astype(jnp.float32)
            return rows[..., : self.latent_dim], rows[..., self.latent_dim :]
        lead = rows.shape[:-1]
        words = rows[..., : self.scale_offset]
        q = jnp.stack([fp8_byte(words, j) for j in range(4)], axis=-1).reshape(*lead, self.num_groups, self.group_size)
        scale = jax.lax.bitcast_convert_type(rows[..., self.scale_offset : self.rope_offset], jnp.float32)
        latent = (q.astype(jnp.float32) * scale[..., None]).reshape(*lead, self.latent_dim)
        words = rows[..., self.rope_offset :]
        rope = jnp.stack([bf16_half(words, j) for j in range(2)], axis=-1).reshape(*lead, self.rope_dim)
        return latent, rope.astype(jnp.float32)

    def to_stored(self, rows: jax.Array) -> jax.Array:
        """Rows as the state stores them: row[..., width] of `dtype` as they are, or their values
        [..., latent_dim + rope_dim] (any float dtype) packed. For plain layouts the two are the
        same shape and this is a cast. Raises ValueError for any other width."""
        self.check_rows("rows", rows)
        if not self.quantized:
            return rows.astype(self.dtype)
        if rows.shape[-1] == self.width and rows.dtype == self.dtype:
            return rows
        return self.pack(rows[..., : self.latent_dim], rows[..., self.latent_dim :])

    def check_rows(self, name: str, rows) -> None:
        """Raises ValueError unless rows[..., X] are stored rows (X = width, of `dtype`) or row
        values (X = latent + rope, floats): what to_stored takes. Static: shape and dtype only."""
        width = rows.shape[-1]
        if not self.quantized:
            check_equal(f"{name} width", width, "the state's row width", self.width)
            return
        if (width == self.width and rows.dtype == self.dtype) or (
            width == self.logical_width and jnp.issubdtype(rows.dtype, jnp.floating)
        ):
            return
        raise ValueError(
            f"{name} ({np.dtype(rows.dtype).name}, width {width}) must be stored rows ({self.dtype.name}, width"
            f" {self.width}) or row values (floats, width {self.logical_width} = latent + rope) of the {self.kind} layout"
        )

    # ---- choosing a layout ------------------------------------------------------------------

    @classmethod
    def for_dtype(cls, latent_dim: int, rope_dim: int, dtype) -> "KVRowLayout":
        """The plain layout holding rows in `dtype` (bfloat16 or float32)."""
        name = np.dtype(dtype).name
        if name not in _PLAIN_LAYOUTS:
            raise ValueError(f"no KV row layout stores {name}; use bfloat16 or float32")
        return cls(latent_dim, rope_dim, name)

    @classmethod
    def for_kv_cache_dtype(cls, latent_dim: int, rope_dim: int, model_dtype, kv_cache_dtype: str = "auto") -> "KVRowLayout":
        """The layout SGLang's --kv-cache-dtype names: "auto" stores rows in the model dtype
        (for_dtype), "bfloat16" / "float32" plain rows, "fp8_e4m3" FlashMLA's 656 B fp8 rows."""
        if kv_cache_dtype == "auto":
            return cls.for_dtype(latent_dim, rope_dim, model_dtype)
        if kv_cache_dtype not in KINDS:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        return cls(latent_dim, rope_dim, kv_cache_dtype)


def _round_up_scale(scale: jax.Array) -> jax.Array:
    """f32 >= 0 -> the next f32 with its low _SCALE_LOW_BITS mantissa bits clear (0 stays 0)."""
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    low = (1 << _SCALE_LOW_BITS) - 1
    bits = jnp.where(bits & low, (bits | low) + 1, bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def fp8_byte(words: jax.Array, j: int) -> jax.Array:
    """Byte j (bits 8j .. 8j + 7) of each uint32 word as float8_e4m3fn, same shape."""
    return jax.lax.bitcast_convert_type(((words >> (8 * j)) & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)


def bf16_half(words: jax.Array, j: int) -> jax.Array:
    """Half j (0: bits 0 .. 15, 1: bits 16 .. 31) of each uint32 word as bfloat16, same shape."""
    return jax.lax.bitcast_convert_type(((words >> (16 * j)) & 0xFFFF).astype(jnp.uint16), jnp.bfloat16)
