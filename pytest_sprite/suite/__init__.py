"""The shipped distributed-correctness suite: ``pytest --pyargs pytest_sprite.suite --ranks=W``.

Runs at every listed world size up to W (the rest are skipped with the reason), on the device the
ranks find (XPU tiles, CUDA GPUs, else the CPU with gloo): collectives, then FP32 parity of the
repository's DDP and FSDP2 strategies against one device, then the planted faults that parity must reject,
then BF16 parity by criterion v2 and its eight fault cases (at the session's world size only).
"""
