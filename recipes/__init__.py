"""Training recipes that run unchanged on every parallelx backend.

From a checkout of the repository::

    python -m recipes.cifar10 --backend single
    torchrun --nproc-per-node 2 -m recipes.cifar10 --backend ddp
    horovodrun -np 2 python -m recipes.dogcat --backend horovod
    deepspeed --num_gpus 2 recipes/dogcat.py --backend deepspeed
    torchrun --nproc-per-node 2 -m recipes.gpt --backend ddp

The training loops: ``train`` in ``classify.py`` (the image recipes', which
``cifar10.py`` and ``dogcat.py`` call with their model) and in ``gpt.py``; the
checkpoints and resuming are a ``parallelx.Checkpointer``'s.  The shared modules
hold the command line (``common.py``), the data and loaders (``data.py``,
``make_data.py``), the models (``models.py``) and the files written at the end
(``history.py``).

Installed, the same modules are ``parallelx.recipes`` (``python -m
parallelx.recipes.cifar10``).  Inside the package every import is relative, so
both names work, and so does running a recipe as a file (as the deepspeed
launcher does).
"""
