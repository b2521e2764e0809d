"""Row copies between the pinned host pool and the device: missed rows host -> device buffer, gathers into a fresh array, newest rows device -> host.

One folder per op: api.py (the public entry, `implementation=` "reference" | "pallas" | "tpu"),
base.py (types, constants, input checks), reference.py (the jnp reference the tests compare
against), pallas_triton.py (the GPU kernel), pallas_tpu.py (the TPU kernel, imported only when
asked for). Files here: api.py, base.py, reference.py, pallas_triton.py, pallas_tpu.py.
"""

from pallas_kernels.row_copy.api import copy_host_rows_to_buffer, gather_host_rows, write_all_layer_rows_to_host, write_rows_to_host
from pallas_kernels.row_copy.base import DEFAULT_ROWS_PER_PROGRAM, check_copy_inputs, check_write_all_layers_inputs, check_write_inputs
from pallas_kernels.common import num_sms
from pallas_kernels.row_copy.pallas_triton import (
    PROGRAMS_PER_SM,
    copy_grid_size,
    copy_host_rows_to_buffer_pallas,
    gather_host_rows_pallas,
    write_all_layer_rows_to_host_pallas,
    write_rows_to_host_pallas,
)
from pallas_kernels.row_copy.reference import (
    copy_host_rows_to_buffer_reference,
    gather_host_rows_reference,
    write_all_layer_rows_to_host_reference,
    write_rows_to_host_reference,
)

__all__ = ['DEFAULT_ROWS_PER_PROGRAM', 'PROGRAMS_PER_SM', 'check_copy_inputs', 'check_write_inputs', 'copy_grid_size', 'copy_host_rows_to_buffer', 'copy_host_rows_to_buffer_pallas', 'copy_host_rows_to_buffer_reference', 'gather_host_rows', 'gather_host_rows_pallas', 'gather_host_rows_reference', 'num_sms', 'write_all_layer_rows_to_host', 'write_all_layer_rows_to_host_pallas', 'write_all_layer_rows_to_host_reference', 'check_write_all_layers_inputs', 'write_rows_to_host', 'write_rows_to_host_pallas', 'write_rows_to_host_reference']
