"""HiSparse configuration, parsed from the same JSON that SGLang's `--hisparse-config` takes.

    HiSparseConfig.from_json('{"top_k": 2048, "device_buffer_size": 4096,'
                             ' "host_to_device_ratio": 8, "swap_in_block_size": 960}')

Defaults follow SGLang: top_k 2048, host_to_device_ratio 2, swap_in_block_size 960, and in
from_json (the JSON path) device_buffer_size 2 * top_k. The constructor's own default for
device_buffer_size is 4096 (2 x the default top_k) whatever top_k is: HiSparseConfig(top_k=16)
has 4096 slots, HiSparseConfig.from_json('{"top_k": 16}') 32. Every error names the offending field.

Dynamic residency (SGLang's / vLLM's hybrid HiSparse) is an optional nested object:

    {"top_k": 2048, "dynamic_residency": {"mode": "adaptive",
                                          "promote_watermark": 0.5, "demote_watermark": 0.1}}

Absent, every request is host-backed (the plain hot buffer); see ResidencyConfig. SGLang's own
spelling, flat keys beside `"dynamic_residency": true`, is read as the same object:

    {"top_k": 2048, "dynamic_residency": true, "dynamic_residency_mode": "adaptive",
     "dynamic_residency_promote_watermark": 0.5, "dynamic_residency_demote_watermark": 0.1}

(a flat key left out takes ResidencyConfig's default, not SGLang's: SGLang's promote watermark is
0.2). "shared_prefetch" picks how shared-index layers (GLM-5.x's IndexShare) fetch their rows:
"ffi_stream" (a CUDA stream of our own, overlapped with the anchor layer), "stream" / "early"
(A/B modes), "off" (in line); left out, "ffi_stream" on a CUDA GPU that can build it (nvcc),
else "off" (hisparse_jax.attention_layer.shared_prefetch_mode; $HISPARSE_SHARED_PREFETCH still
overrides the default, for A/B runs). SGLang keys this library does not implement (dynamic_residency_max_tokens and the other
admission limits, algorithm, backend, ...) are refused by name rather than ignored.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

_DEFAULT_TOP_K = 2048
_DEFAULT_HOST_TO_DEVICE_RATIO = 2
_DEFAULT_SWAP_IN_BLOCK_SIZE = 960
_MAX_SWAP_IN_BLOCK_SIZE = 1024  # a CUDA thread block's limit; SGLang enforces the same range
SHARED_PREFETCH_MODES = ("ffi_stream", "stream", "early", "off")  # shared-index layers' row fetch
MISS_READ_MODES = ("copy", "attention")  # how a decode step's missed rows reach attention


class HiSparseConfigError(ValueError):
    """A `--hisparse-config` value is malformed; the message names the field."""


def _require_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass in Python; `true` in JSON must not pass as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise HiSparseConfigError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise HiSparseConfigError(f"{name} must be positive, got {value}")


def _fields_of(cls, values, name: str) -> dict:
    """values as keyword arguments of dataclass `cls`: a JSON object of its fields only (the
    errors name `name`, the object's place in --hisparse-config)."""
    if not isinstance(values, Mapping):
        raise HiSparseConfigError(f"{name} must be a JSON object, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise HiSparseConfigError(f"unknown {name} field(s) {unknown}; expected some of {sorted(known)}")
    return dict(values)


RESIDENCY_MODES = ("adaptive", "forced_resident", "forced_host_backed")
_FLAT_RESIDENCY_PREFIX = "dynamic_residency_"  # SGLang's flat spelling: dynamic_residency_<field>
# SGLang --hisparse-config keys with no counterpart here: refused by name, never silently dropped.
_SGLANG_ONLY_KEYS = frozenset(
    {"algorithm", "backend", "min_sparse_prompt_len", "page_size", "dynamic_residency_max_tokens",
     "dynamic_residency_max_requests", "dynamic_residency_min_remaining_tokens", "dynamic_residency_cooldown_steps",
     "dynamic_residency_admission_window_seconds"}
)  # fmt: skip


def normalized(values: Mapping[str, Any]) -> dict:
    """A parsed --hisparse-config object in this library's spelling: SGLang's flat residency keys
    (`"dynamic_residency": true` + `dynamic_residency_mode`, `..._promote_watermark`,
    `..._demote_watermark`) become the nested `dynamic_residency` object; `"dynamic_residency":
    false` is no residency. SGLang keys not implemented here raise, naming them."""
    if not isinstance(values, Mapping):
        raise HiSparseConfigError(f"hisparse_config must be a JSON object, got {type(values).__name__}")
    values = dict(values)
    unsupported = sorted(_SGLANG_ONLY_KEYS & set(values))
    if unsupported:
        raise HiSparseConfigError(f"SGLang's hisparse_config field(s) {unsupported} are not supported here; drop them")
    flat = {k[len(_FLAT_RESIDENCY_PREFIX) :]: values.pop(k) for k in list(values) if k.startswith(_FLAT_RESIDENCY_PREFIX)}
    switch = values.get("dynamic_residency")
    if isinstance(switch, bool):
        if flat and not switch:
            raise HiSparseConfigError(f"dynamic_residency_* fields {sorted(flat)} are set but dynamic_residency is false")
        values["dynamic_residency"] = flat if switch else None
        if values["dynamic_residency"] is None:
            del values["dynamic_residency"]
    elif flat:
        raise HiSparseConfigError(
            f"dynamic_residency_{sorted(flat)[0]} needs \"dynamic_residency\": true (SGLang's flat spelling) or"
            " the nested object {\"dynamic_residency\": {...}}"
        )
    return values


@dataclasses.dataclass(frozen=True)
class ResidencyConfig:
    """Which requests keep their whole KV on the device (serving.residency).

    mode: "adaptive" - a request is promoted to resident (its context copied into device pages
      once; then no plan and no copy) while free device pages stay above promote_watermark after
      the promotion, and residents are demoted back to host-backed (nothing copied) when free
      pages fall below demote_watermark or a new request needs its buffer;
      "forced_resident" - every request resident from admission, which waits for its pages;
      "forced_host_backed" - every request host-backed, on the paged pool (for comparisons).
    promote_watermark, demote_watermark: fractions of the device pool's pages, 0 <= demote <=
      promote <= 1.
    """

    mode: str = "adaptive"
    promote_watermark: float = 0.5
    demote_watermark: float = 0.1

    def __post_init__(self):
        if self.mode not in RESIDENCY_MODES:
            raise HiSparseConfigError(f"dynamic_residency.mode must be one of {list(RESIDENCY_MODES)}, got {self.mode!r}")
        for name in ("promote_watermark", "demote_watermark"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise HiSparseConfigError(f"dynamic_residency.{name} must be a number in [0, 1], got {value!r}")
        if self.demote_watermark > self.promote_watermark:
            raise HiSparseConfigError(
                f"dynamic_residency.demote_watermark ({self.demote_watermark}) must not exceed promote_watermark"
                f" ({self.promote_watermark})"
            )

    @classmethod
    def from_dict(cls, values) -> "ResidencyConfig":
        return cls(**_fields_of(cls, values, "dynamic_residency"))


@dataclasses.dataclass(frozen=True)
class HiSparseConfig:
    """What HiSparse needs to size and run its buffers.

    top_k: entries the indexer selects per step (the model's `index_topk`).
    device_buffer_size: LRU slots per request per sparse layer on the device (B); >= top_k so a
      step's misses always find victims.
    host_to_device_ratio: host pool size relative to the device pool; sizes pinned host memory.
    swap_in_block_size: SGLang's swap-in thread-block size (threads; one warp copies one row).
      Here it sets how many rows one copy program moves: the largest power of two <= its warps
      (960 -> 30 warps -> 16 rows, the launch shape measured in docs/PERFORMANCE.md).
    miss_read: how a decode step's missed rows reach attention. "copy": a copy kernel moves them
      host -> device slots, then attention reads every row from the device (SGLang's order).
      "attention": the attention kernel reads them from the pinned pool itself, over PCIe, as it
      attends, and writes them to their slots: no copy launch, no wait before attention, the
      same result bit for bit (fp8 rows: as the kernel's interleave form over copied rows, which
      rounds differently from the default dequantize_first; docs/architecture.md, "Reading
      misses in attention"). Decode
      layers with their own indexer only; the paged pool (dynamic_residency) takes "copy".
      Opt-in: on the H200 it is no faster at 64 heads and slower at 128 (docs/PERFORMANCE.md).
    """

    top_k: int = _DEFAULT_TOP_K
    device_buffer_size: int = 2 * _DEFAULT_TOP_K
    host_to_device_ratio: int = _DEFAULT_HOST_TO_DEVICE_RATIO
    swap_in_block_size: int = _DEFAULT_SWAP_IN_BLOCK_SIZE
    dynamic_residency: ResidencyConfig | None = None  # None: every request host-backed
    shared_prefetch: str | None = None  # one of SHARED_PREFETCH_MODES; None: the default (see above)
    miss_read: str = "copy"  # one of MISS_READ_MODES (see the class docstring)

    def __post_init__(self):
        if self.shared_prefetch is not None and self.shared_prefetch not in SHARED_PREFETCH_MODES:
            raise HiSparseConfigError(f"shared_prefetch must be one of {SHARED_PREFETCH_MODES}, got {self.shared_prefetch!r}")
        if self.miss_read not in MISS_READ_MODES:
            raise HiSparseConfigError(f"miss_read must be one of {MISS_READ_MODES}, got {self.miss_read!r}")
        for field in dataclasses.fields(self):
            if field.name not in ("dynamic_residency", "shared_prefetch", "miss_read"):
                _require_positive_int(field.name, getattr(self, field.name))
        if isinstance(self.dynamic_residency, Mapping):  # to_json's nested object read back
            object.__setattr__(self, "dynamic_residency", ResidencyConfig.from_dict(self.dynamic_residency))
        if self.dynamic_residency is not None and not isinstance(self.dynamic_residency, ResidencyConfig):
            raise HiSparseConfigError(f"dynamic_residency must be a JSON object, got {self.dynamic_residency!r}")
        if self.device_buffer_size < self.top_k:
            raise HiSparseConfigError(
                f"device_buffer_size ({self.device_buffer_size}) must be >= top_k ({self.top_k}):"
                " a step's misses need that many evictable slots"
            )
        if self.swap_in_block_size > _MAX_SWAP_IN_BLOCK_SIZE:
            raise HiSparseConfigError(
                f"swap_in_block_size ({self.swap_in_block_size}) must be in [1, {_MAX_SWAP_IN_BLOCK_SIZE}]"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "HiSparseConfig":
        """The config of a parsed `--hisparse-config` object (this library's or SGLang's
        spelling, see normalized); unknown fields raise."""
        values = _fields_of(cls, normalized(values), "hisparse_config")
        # SGLang's default buffer is twice the top_k the user gave, not twice the default top_k.
        if "device_buffer_size" not in values and "top_k" in values:
            _require_positive_int("top_k", values["top_k"])
            values["device_buffer_size"] = 2 * values["top_k"]
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | None) -> "HiSparseConfig":
        """Parses `--hisparse-config`; None or an empty string gives the defaults."""
        if text is None or not text.strip():
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise HiSparseConfigError(f"hisparse_config is not valid JSON: {error}") from None
        return cls.from_dict(values)

    @property
    def copy_rows_per_program(self) -> int:
        """Rows one program of the host -> device copy kernel moves (pallas_kernels.row_copy)."""
        warps = max(1, self.swap_in_block_size // 32)
        return 1 << (warps.bit_length() - 1)

    def to_json(self) -> str:
        """The JSON object from_json reads back to an equal config."""
        return json.dumps(dataclasses.asdict(self))
