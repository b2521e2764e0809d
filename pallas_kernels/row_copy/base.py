"""Row copies' constants and input checks, shared by their implementations."""

from __future__ import annotations

from pallas_kernels.common import check_equal, check_layer_index, check_rank

DEFAULT_ROWS_PER_PROGRAM = 16  # rows per work item of the copy (HiSparseConfig.copy_rows_per_program)


def check_copy_inputs(pool, device_buffer, layer, miss_host, miss_device, num_misses) -> None:
    """Static shape checks of the host -> device copy."""
    check_rank("pool", pool, 3, "[L, S, W]")
    check_rank("device_buffer", device_buffer, 4, "[L, R, B1, W]")
    check_rank("miss_host", miss_host, 2, "[R, K]")
    check_equal("device_buffer row width", device_buffer.shape[3], "pool row width (W)", pool.shape[2])
    check_equal("device_buffer layers", device_buffer.shape[0], "pool layers (L)", pool.shape[0])
    check_equal("miss_device shape", miss_device.shape, "miss_host shape", miss_host.shape)
    # A batch of b <= R requests copies into slots 0 .. b - 1 (the engine's batch buckets); a
    # device_buffer with one request slot is a pool shared by the batch (miss_device: its rows).
    if miss_host.shape[0] > device_buffer.shape[1] != 1:
        raise ValueError(
            f"miss_host batch ({miss_host.shape[0]}) must not exceed the device_buffer request slots (R = {device_buffer.shape[1]})"
        )
    check_rank("num_misses", num_misses, 1, "[R]")
    check_equal("num_misses batch", num_misses.shape[0], "miss_host batch (R)", miss_host.shape[0])
    check_layer_index(layer, pool.shape[0])


def check_write_all_layers_inputs(pool, rows, host_slots) -> None:
    """Static shape checks of the device -> host write of every layer's rows."""
    check_rank("pool", pool, 3, "[L, S, W]")
    check_rank("rows", rows, 3, "[L, N, W]")
    check_equal("rows layers", rows.shape[0], "pool layers (L)", pool.shape[0])
    check_equal("rows width", rows.shape[2], "pool row width (W)", pool.shape[2])
    check_rank("host_slots", host_slots, 1, "[N]")
    check_equal("host_slots length", host_slots.shape[0], "rows per layer (N)", rows.shape[1])


def check_write_inputs(pool, layer, rows, host_slots) -> None:
    """Static shape checks of the device -> host write."""
    check_rank("pool", pool, 3, "[L, S, W]")
    check_rank("rows", rows, 2, "[N, W]")
    check_equal("rows width", rows.shape[1], "pool row width (W)", pool.shape[2])
    check_rank("host_slots", host_slots, 1, "[N]")
    check_equal("host_slots length", host_slots.shape[0], "rows (N)", rows.shape[0])
    check_layer_index(layer, pool.shape[0])
