"""A GAN on every backend: two models, two optimizers, D stepped on a real and a
fake batch (two ``backward`` calls), G's loss through D, an EMA of G, and
checkpoints that resume all of it exactly.  See docs/several-models.md.

    python examples/gan.py --out-dir runs/gan                                      # one process
    torchrun --nproc-per-node 2 examples/gan.py --backend ddp --out-dir runs/gan
    torchrun --nproc-per-node 2 examples/gan.py --backend fsdp --out-dir runs/gan
    horovodrun -np 2 python examples/gan.py --backend horovod --out-dir runs/gan
    deepspeed --num_gpus 2 examples/gan.py --backend deepspeed --zero-stage 3 --out-dir runs/gan

The data are 2-D points on a ring of 8 Gaussians; the global batch is
``--batch-size`` whatever the world size (each rank takes its share), so every
backend and one process compute the same numbers.  Add ``--checkpoint-every 5``
and, after a stop, ``--resume auto`` to continue where it stopped.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx

NZ = 4  # the noise's width


def ring(n: int, seed: int) -> torch.Tensor:
    """``n`` points around 8 Gaussians on the unit circle."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.randint(0, 8, (n,), generator=g).float() * (2 * math.pi / 8)
    centres = torch.stack([angle.cos(), angle.sin()], dim=1)
    return centres + 0.05 * torch.randn(n, 2, generator=g)


def mlp(n_in: int, n_out: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(n_in, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2), nn.Linear(32, n_out)
    )


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parallelx.add_arguments(p)  # --backend (the launcher's by default), --zero-stage, --precision, ...
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="the global batch (every rank's together)")
    p.add_argument("--ema-decay", type=float, default=0.9)
    p.add_argument("--out-dir", type=Path, default=Path("runs/gan"))
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--resume", default=None, help="auto, a checkpoint, or nothing for a fresh start")
    return p


def train(backend: parallelx.Backend, args: argparse.Namespace) -> None:
    parallelx.seed_everything(0)  # the same initial weights on every rank
    g, d = mlp(NZ, 2), mlp(2, 1)

    def adam(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(m.parameters(), lr=2e-3, betas=(0.5, 0.999))

    g, opt_g = backend.setup(g, adam(g))  # one setup per model, each with its optimizer
    d, opt_d = backend.setup(d, adam(d))
    ema = parallelx.EMA(backend, g, decay=args.ema_decay)  # after setup: as sharded as G

    per_rank = args.batch_size // backend.world_size
    data = TensorDataset(ring(512, seed=1))
    sampler = backend.make_sampler(data, shuffle=True, seed=2)
    loader = DataLoader(data, batch_size=per_rank, sampler=sampler, drop_last=True)
    noise_gen = torch.Generator().manual_seed(3)  # the global batch's noise; each rank takes its rows

    ckpt = parallelx.Checkpointer(
        backend,
        args.out_dir,
        every=args.checkpoint_every,
        g=g,
        d=d,
        g_opt=opt_g,
        d_opt=opt_d,
        ema=ema,
        sampler=sampler,
        noise=noise_gen.get_state(),
    )
    ckpt.resume(args.resume)
    noise_gen.set_state(ckpt["noise"])
    bce = nn.BCEWithLogitsLoss()
    with ckpt:
        for epoch in ckpt.epochs(args.epochs):
            for (real,) in ckpt.batches(loader):
                real = real.to(backend.device)
                noise = torch.randn(args.batch_size, NZ, generator=noise_gen)
                fake = g(noise[backend.rank :: backend.world_size].to(backend.device))
                ones = torch.ones(real.size(0), 1, device=backend.device)
                zeros = torch.zeros(real.size(0), 1, device=backend.device)

                opt_d.zero_grad()  # G's last backward reached D's parameters
                backend.backward(bce(d(real), ones))  # D on the real batch
                backend.backward(bce(d(fake.detach()), zeros))  # and on the fake one: the gradients add up
                backend.step(opt_d)  # steps and zeroes D only
                loss_g = bce(d(fake), ones)  # G's loss through D: D gets gradients too
                backend.backward(loss_g)
                backend.step(opt_g)  # steps and zeroes G only
                ema.update()
                ckpt["noise"] = noise_gen.get_state()
                if ckpt.step():  # preempted: saved on every rank
                    return
            backend.print(f"epoch {epoch}: loss_g {loss_g.item():.4f}")

    with ema.swapped():  # G with the averaged weights
        sample = g(torch.randn(4, NZ, generator=torch.Generator().manual_seed(4)).to(backend.device))
    backend.print(f"EMA samples (radius ~1): {sample.detach().norm(dim=1).cpu().tolist()}")
    backend.save({"g": g, "d": d, "ema": ema.model_state_dict()}, args.out_dir / "final.pt")


def main() -> None:
    args = arguments().parse_args()
    with parallelx.from_args(args) as backend:
        train(backend, args)


if __name__ == "__main__":
    main()
