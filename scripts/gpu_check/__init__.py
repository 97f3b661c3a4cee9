"""The GPU check: parallelx's paths that only run on CUDA, checked in one command.

On a GPU machine, from the repository root (``scripts/gpu_check.sh`` first
installs the wheels that ``scripts/gpu_wheels.py`` put in ``gpu-wheels/``)::

    bash scripts/gpu_check.sh                            # 8 minutes at most; report in $OUT or gpu-report/

On a CPU machine (CI runs this, so that the check cannot rot): everything
except what needs CUDA, which the report lists as skipped, with the reason::

    .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/gpu-report

What it checks, one process per GPU (two processes on the CPU):

- **install**: what ``gpu_check.sh`` installed, and Horovod built from its sdist
  with NCCL operations in the background while the rest runs (its checks run
  if the build finishes in time, else they are skipped);
- **environment**: versions, the GPUs, ``python -m parallelx env``, and whether
  the installed parallelx is this checkout;
- **recipes**: CIFAR-10 LeNet and Dogs-vs-Cats VGG16 on ``single``, ``dp``,
  ``ddp`` (torchrun, NCCL), ``deepspeed`` and ``horovod``, each under its own
  launcher; the val figures in ``metrics.json`` must equal a single-process
  evaluation of ``best.pth``;
- **throughput**: Dogs-vs-Cats VGG16 at 224 px, 32 images per process,
  parallelx's DDP step against the plain DDP script's in the same processes
  (``benchmarks/same_process.py``), per precision in ``check.PRECISIONS``;
- **host-sync**: the recipes' training loop under
  ``torch.cuda.set_sync_debug_mode("warn")``: synchronisations with the host
  per step against the plain framework's loop on the same loader, and the
  two loops' step times.

Every step has a timeout and the whole run a deadline; a failed step is
recorded and the others still run; ``report.md`` and ``summary.json`` are
rewritten after every step.  The exit status is 0 when every check that ran
passed.  ``check.py`` holds the settings and the machinery, ``sections.py``
the steps and ``main``, ``workers.py`` what runs in the processes the check
starts; launches go through ``parallelx.runner``.
"""
