"""Build (or load) the DeepSpeed ops an NVMe-offload run needs, once, before the tests that run one:

    python -m tests.train.finetune_extras._nvme_ops     # the NVMe tests' fixture runs it (test_finetune_nvme.py)

async_io (ZeRO-Infinity's reads and writes; it loads the pin_memory op first) and cpu_adam (the optimizer an
offloaded run steps with). Each is a torch JIT extension compiled into torch's extension folder (TORCH_EXTENSIONS_DIR,
by default ~/.cache/torch_extensions/py<ver>_<cpu|cuXY>/<op>): minutes the first time on 2 cores (async_io about 7-15,
cpu_adam 2-4), a second once built. The folder is shared by every environment of that Python, but its build.ninja
names one environment's DeepSpeed sources, so another environment's DeepSpeed rebuilds it. torch holds a lock in the
op's folder while it builds, so two processes never build one op at once (the second waits and loads it).

Exits 0 when both load; 3, with the reason on stderr, where the async_io op cannot run here (no libaio:
adaptive.engine.async_io_unavailable); anything else is an error.
"""

from __future__ import annotations

import sys
import time

UNAVAILABLE = 3


def main() -> int:
    from adaptive.engine import name_cpu_accelerator, pin_ninja

    name_cpu_accelerator()
    pin_ninja()  # the ninja the runs build with: another one's build is rebuilt (adaptive.engine.pin_ninja)
    from deepspeed.accelerator import get_accelerator

    from adaptive.engine import async_io_unavailable

    why = async_io_unavailable()
    if why is not None:
        sys.stderr.write(f"DeepSpeed's async_io op cannot run here: {why}\n")
        return UNAVAILABLE
    for name in ("AsyncIOBuilder", "CPUAdamBuilder"):
        started = time.monotonic()
        builder = get_accelerator().create_op_builder(name)
        builder.load(verbose=False)
        sys.stdout.write(f"{builder.absolute_name()}: loaded in {time.monotonic() - started:.1f} s\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
