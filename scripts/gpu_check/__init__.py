"""The GPU check: parallelx's paths that only run on CUDA, checked in one command.

On a GPU machine, from the repository root (``scripts/gpu_check.sh`` first
installs the wheels that ``scripts/gpu_wheels.py`` put in ``gpu-wheels/``)::

    bash scripts/gpu_check.sh                            # 8 minutes at most; report in $OUT or gpu-report/

On a CPU machine (CI runs this, so that the check cannot rot): everything
except what needs CUDA, which the report lists as skipped, with the reason::

    .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/gpu-report

What it checks, one process per GPU (two processes on the CPU):

- **environment**: versions (torch, CUDA, NCCL, cuDNN, the GPUs), ``python -m
  parallelx env``, and whether the installed parallelx is this checkout;
- **recipes**: CIFAR-10 LeNet and Dogs-vs-Cats VGG16 on ``single``, ``dp``,
  ``ddp`` (torchrun, NCCL), ``deepspeed`` and ``horovod`` (once built), each
  under its own launcher; the val figures reported in ``metrics.json`` must
  equal a single-process evaluation of ``best.pth``;
- **throughput**: Dogs-vs-Cats VGG16 at 224 px, 32 images per process,
  parallelx's DDP step against the plain DDP script's in the same processes
  (``benchmarks/same_process.py``), per precision in :data:`PRECISIONS`;
- **host-sync**: the recipes' training loop (``recipes.engine.run_epoch``)
  under ``torch.cuda.set_sync_debug_mode("warn")``: synchronisations with the
  host per step, against the plain framework's loop on the same loader, and
  the two loops' step times;
- **install**: what ``gpu_check.sh`` installed, and Horovod built from its
  sdist with NCCL operations, in the background while the rest runs; its
  checks run if the build finishes in time, else they are skipped.

Every step has a timeout and the whole run a deadline; a failed step is
recorded and the others still run.  ``report.md`` and ``summary.json`` are
rewritten after every step, so a run cut short still leaves its report.  The
exit status is 0 when every check that ran passed, 1 otherwise.

Where things are in this package (``scripts/gpu_check.py`` runs it):

- ``settings.py``: the budget, the backends and precisions, what runs on CUDA
  and in the dry run;
- ``check.py`` and ``report.py``: steps run against the deadline, and the
  report they make;
- ``launching.py``: launches under each backend's launcher, logged, and killed
  at their timeout;
- ``sections/``: one module per section of the report, each adding its steps
  to :class:`~gpu_check.sections.GpuCheck`;
- ``sync_worker.py`` and ``horovod_build.py``: what runs in the processes the
  check starts (through ``scripts/gpu_check.py`` as well);
- ``cli.py``: the options, and the order in which the sections run.
"""
