"""Swap-in plan: map each selected position to a device slot, LRU-evicting on misses (the contract: api.py, docs/contract.md).

One folder per op: api.py (the public entry, `implementation=` "reference" | "pallas" | "tpu"),
base.py (types, constants, input checks), reference.py (the jnp reference the tests compare
against), pallas_triton.py (the GPU kernel), pallas_tpu.py (the TPU kernel, imported only when
asked for). Files here: api.py, base.py, reference.py, pallas_triton.py, pallas_tpu.py.
"""

from pallas_kernels.swap_in.api import swap_in_plan
from pallas_kernels.swap_in.base import SCRATCH_EMPTY, SwapInPlan, check_plan_inputs, host_slots_of
from pallas_kernels.swap_in.reference import swap_in_plan_reference
from pallas_kernels.swap_in.pallas_triton import swap_in_plan_pallas

__all__ = ['SCRATCH_EMPTY', 'SwapInPlan', 'check_plan_inputs', 'host_slots_of', 'swap_in_plan', 'swap_in_plan_pallas', 'swap_in_plan_reference']
