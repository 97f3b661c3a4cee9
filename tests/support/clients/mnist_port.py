"""pytorch/examples' MNIST script, ported to parallelx the way the README shows:
the same file runs under python, torchrun, horovodrun and the deepspeed launcher.

    torchrun --nproc-per-node 2 tests/support/clients/mnist_port.py --data-dir DIR
    horovodrun -np 2 python tests/support/clients/mnist_port.py --data-dir DIR
    deepspeed --num_gpus 2 tests/support/clients/mnist_port.py --data-dir DIR --zero-stage 2

What a user changes from the original: the backend's argparse options, ``with
backend``, ``wrap_model`` / ``wrap_optimizer``, ``backend.backward``, a sharded
sampler, and test figures summed over the ranks with ``MetricSums``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms

import parallelx


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, backend, model, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(backend.device), target.to(backend.device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        backend.backward(loss)
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            backend.print(
                f"Train Epoch: {epoch} [{batch_idx * len(data) * backend.world_size}/"
                f"{len(train_loader.dataset)}]\tLoss: {loss.item():.6f}"
            )


def test(backend, model, test_loader):
    model.eval()
    sums = parallelx.MetricSums(test_loader.sampler)
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(backend.device), target.to(backend.device)
            output = model(data)
            sums.update(F.nll_loss(output, target, reduction="none"), output.argmax(dim=1) == target)
    m = sums.compute(backend)
    backend.print(
        f"\nTest set: Average loss: {m['loss']:.6f}, Accuracy: {m['correct']}/{m['count']} ({100.0 * m['acc']:.2f}%)\n"
    )


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--test-batch-size", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=128)
    parser.add_argument("--data-dir", default="../data")
    parser.add_argument("--save-model", default=None)
    parallelx.add_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    with parallelx.from_args(args) as backend:
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
        dataset1 = Subset(
            datasets.MNIST(args.data_dir, train=True, download=False, transform=transform), range(args.train_size)
        )
        dataset2 = datasets.MNIST(args.data_dir, train=False, transform=transform)
        train_loader = DataLoader(
            dataset1, batch_size=args.batch_size, sampler=backend.make_sampler(dataset1, shuffle=True, seed=args.seed)
        )
        test_loader = DataLoader(
            dataset2, batch_size=args.test_batch_size, sampler=backend.make_sampler(dataset2, shuffle=False)
        )

        model = backend.wrap_model(Net())
        optimizer = backend.wrap_optimizer(optim.Adadelta(model.parameters(), lr=args.lr))
        scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
        for epoch in range(1, args.epochs + 1):
            train(args, backend, model, train_loader, optimizer, epoch)
            test(backend, model, test_loader)
            scheduler.step()
            backend.print(f"lr {optimizer.param_groups[0]['lr']:.6f}")
        if args.save_model:
            backend.save(model, args.save_model)


if __name__ == "__main__":
    main()
