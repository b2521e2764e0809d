"""The paged device pool behind dynamic residency (hisparse_jax.paged_state), layer by layer.

Same small sizes and helpers as test_attention_layer: the no-offload FullKVState and a
PagedHiSparseState decode the same rows and selections; requests are promoted to resident and
demoted back mid-decode, and every step's attention output must equal the no-offload one bit
for bit. Unwritten pool and host rows are NaN, so a read through a wrong page shows.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig, HiSparseConfigError, ResidencyConfig
from hisparse_jax.paged_state import PagedHiSparseState, buffer_pages
from hisparse_jax.row_layout import KVRowLayout
from hisparse_jax.state import FullKVState, jit_donating_state
from test_attention_layer import B, C, K, L, LATENT, PAGE, R, ROPE, decode_step_fn, prefill, recent_and_random

BUFFER_PAGES = buffer_pages(B, PAGE)  # 3 pages of 8 rows hold B + 1 = 17 slots
CONTEXT_PAGES = C // PAGE  # 16 pages hold a whole context
POOL_PAGES = R * BUFFER_PAGES + 2 * CONTEXT_PAGES  # room for two residents beside the buffers


def make_states(layout_kind):
    layout = KVRowLayout(LATENT, ROPE, layout_kind)
    config = HiSparseConfig(top_k=K, device_buffer_size=B, host_to_device_ratio=8, dynamic_residency=ResidencyConfig())
    paged = PagedHiSparseState.create(
        num_layers=L, num_requests=R, max_context=C, config=config, layout=layout, num_host_pages=R * C // PAGE + 3,
        num_device_pages=POOL_PAGES, page_size=PAGE, fill_value=jnp.nan,
    )  # fmt: skip
    full = FullKVState.create(num_layers=L, num_requests=R, max_context=C, layout=layout, fill_value=jnp.nan)
    return paged, full


def page_row(pages):
    row = np.full(CONTEXT_PAGES, -1, np.int32)
    row[: len(pages)] = pages
    return jnp.asarray(row)


@pytest.mark.parametrize(
    "implementation,layout_kind",
    # CI time: the Pallas f32 case (~19 s) is under -m slow; Pallas fp8 runs the same pool reads and writes
    [("reference", "float32"), pytest.param("pallas", "float32", marks=pytest.mark.slow), ("pallas", "fp8_e4m3")],
)
def test_promotions_and_demotions_equal_no_offload(implementation, layout_kind):
    steps, prompt_lens = 36, [3, 12, 60]
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((L, R, max(prompt_lens) + steps, LATENT + ROPE)).astype(np.float32)
    queries = rng.standard_normal((steps, L, R, 4, LATENT + ROPE)).astype(np.float32)
    paged, full = make_states(layout_kind)
    # Pages handed out scrambled, so pool rows differ from positions; request 0 starts resident.
    free = list(np.random.default_rng(7).permutation(POOL_PAGES))
    held = {0: [free.pop() for _ in range(CONTEXT_PAGES)]}
    held.update({r: [free.pop() for _ in range(BUFFER_PAGES)] for r in (1, 2)})
    assign = jit_donating_state(lambda s, r, p, res: s.assign_device_pages(r, p, res), paged)
    for r in range(R):
        paged = assign(paged, r, page_row(held[r]), r == 0)
    paged = prefill(paged, rows, prompt_lens, C // PAGE, implementation)
    full = prefill(full, rows, prompt_lens, C // PAGE, implementation)

    step_fn = decode_step_fn(implementation, deferred_backup=True)
    step_paged = jit_donating_state(step_fn, paged, extra_outputs=3)
    step_full = jit_donating_state(step_fn, full, extra_outputs=3)
    promote = jit_donating_state(lambda s, r, p: s.promote(r, p, implementation=implementation), paged)
    demote = jit_donating_state(lambda s, r, p: s.demote(r, p), paged)

    def promote_request(state, r):
        held[r] = held[r] + [free.pop() for _ in range(CONTEXT_PAGES - BUFFER_PAGES)]  # its buffer pages first
        return promote(state, r, page_row(held[r]))

    def demote_request(state, r):
        free.extend(held[r][BUFFER_PAGES:])
        held[r] = held[r][:BUFFER_PAGES]
        return demote(state, r, page_row(held[r]))

    # When to change whom (at most two residents fit): request 1 crosses B while resident,
    # request 0 is demoted on the fast path (n <= B) and later on the long path, request 2 (far
    # beyond B) is promoted twice.
    events = {
        2: [("promote", 1)], 6: [("demote", 0)], 8: [("promote", 2)], 15: [("demote", 2)],
        18: [("promote", 0)], 24: [("demote", 1), ("promote", 2)], 30: [("demote", 0)],
    }  # fmt: skip
    positions = np.array(prompt_lens, np.int32)
    misses_total, resident_steps = 0, 0
    for t in range(steps):
        for action, r in events.get(t, []):
            paged = promote_request(paged, r) if action == "promote" else demote_request(paged, r)
        resident = np.asarray(paged.resident)  # bool[R]
        resident_steps += int(resident.sum())
        topk = np.stack([recent_and_random(rng, positions, layer) for layer in range(L)]).astype(np.int32)
        args = (jnp.asarray(queries[t]), jnp.asarray(rows[:, np.arange(R), positions]), jnp.asarray(positions), jnp.asarray(topk))
        paged, out_p, _, misses = step_paged(paged, *args)
        full, out_f, _, _ = step_full(full, *args)
        assert np.all(np.isfinite(np.asarray(out_p))), f"step {t}: read an unwritten (NaN) row"
        np.testing.assert_array_equal(np.asarray(out_p), np.asarray(out_f), err_msg=f"step {t}: paged != no-offload")
        misses = np.asarray(misses)  # i32[L, R]
        assert not misses[:, resident].any(), f"step {t}: a resident request planned a miss"
        misses_total += int(misses.sum())
        positions += 1
    assert misses_total > 0 and resident_steps > 0, "the run must exercise both host-backed misses and residents"


def test_residency_config_parses_and_names_bad_fields():
    config = HiSparseConfig.from_json('{"top_k": 8, "dynamic_residency": {"mode": "forced_resident"}}')
    assert config.dynamic_residency == ResidencyConfig(mode="forced_resident")
    assert HiSparseConfig.from_json(config.to_json()) == config
    assert HiSparseConfig.from_json('{"top_k": 8}').dynamic_residency is None
    bad = [
        ('{"dynamic_residency": {"mode": "sometimes"}}', "dynamic_residency.mode"),
        ('{"dynamic_residency": {"promote_watermark": 1.5}}', "promote_watermark"),
        ('{"dynamic_residency": {"promote_watermark": 0.2, "demote_watermark": 0.3}}', "demote_watermark"),
        ('{"dynamic_residency": {"watermark": 0.3}}', "watermark"),
        ('{"dynamic_residency": 3}', "dynamic_residency"),
    ]
    for text, named in bad:
        with pytest.raises(HiSparseConfigError, match=named):
            HiSparseConfig.from_json(text)
