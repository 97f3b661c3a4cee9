"""Training recipes that run unchanged on every parallelx backend.

    python -m recipes.cifar10 --backend single
    torchrun --nproc-per-node 2 -m recipes.cifar10 --backend ddp
    horovodrun -np 2 python -m recipes.dogcat --backend horovod
    deepspeed --num_gpus 2 recipes/dogcat.py --backend deepspeed
"""
