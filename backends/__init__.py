"""Built-in parallelx backends: one module each.

Each module imports its heavy package (horovod, deepspeed) only inside its
methods, so listing or importing these modules is cheap and never fails.
"""
