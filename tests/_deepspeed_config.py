"""Validating ds_config dicts with DeepSpeed's own `DeepSpeedConfig` at a chosen data-parallel size."""

import socket

import pytest


@pytest.fixture(scope="module")
def single_process_group():
    """DeepSpeedConfig asks torch.distributed for the world size and only then consults `mpu`."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{port}",
                               rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class DataParallel:
    """DeepSpeed's `mpu` interface: the data-parallel world the config is validated against."""

    def __init__(self, size: int):
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size
