"""A correct script that takes its optimizer steps in each of parallelx's loop forms in turn.

python -m parallelx check -- tests/support/check_scripts/clean_loop_forms.py

Each pass over the loader is one optimizer step (a rank's batch is its whole
shard), and each pass uses the next form of ``--forms``:

- ``protocol``: the card's protocol form, ``loss.backward()`` and a plain
  ``optimizer.step()`` on what ``wrap_model`` / ``wrap_optimizer`` returned;
- ``plain``: ``backend.backward(loss)`` and a plain ``optimizer.step()`` (the
  MNIST port's loop);
- ``step``: ``backend.batches``, ``backend.backward`` and
  ``backend.step(optimizer, scheduler)``.

Every backend computes what one process computes on the global batch, so the
check must exit 0 whatever the form of each step (at its 3 steps by default:
one of each), ZeRO 0 included (parallelx lets its engine take a plain
``loss.backward()``, which DeepSpeed alone refuses there).
"""

import argparse
from collections import OrderedDict

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx

FORMS = ("protocol", "plain", "step")


def main() -> None:
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    parser.add_argument("--forms", default=",".join(FORMS), help="the loop form of each pass, in turn")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--passes", type=int, default=6)
    args = parser.parse_args()
    forms = args.forms.split(",")
    if not set(forms) <= set(FORMS):
        parser.error(f"--forms: each of {', '.join(FORMS)}")
    with parallelx.from_args(args) as backend:
        parallelx.seed_everything(0)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(64, 20, generator=g), torch.randint(0, 3, (64,), generator=g))
        # An MLP's layers by name: under --tensor-parallel the first is split by its outputs, the second by its inputs.
        layers = OrderedDict(fc1=nn.Linear(20, 32), act=nn.Tanh(), fc2=nn.Linear(32, 3))
        model = backend.wrap_model(nn.Sequential(layers))
        optimizer = backend.wrap_optimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-3)
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        sampler = backend.make_sampler(data, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=len(sampler), sampler=sampler)
        criterion = nn.CrossEntropyLoss()
        model.train()
        for i in range(args.passes):
            form = forms[i % len(forms)]
            if form == "step":
                for x, y in backend.batches(loader):
                    loss = criterion(model(x.to(backend.device)), y.to(backend.device))
                    backend.backward(loss)
                    backend.step(optimizer, scheduler)
            else:
                for x, y in loader:
                    loss = criterion(model(x.to(backend.device)), y.to(backend.device))
                    if form == "protocol":
                        loss.backward()
                    else:
                        backend.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    # Zeroed after the step, as backend.step does: whatever form the next step takes, it
                    # starts from zero (DeepSpeed's step clears the gradients itself, torch's does not).
                    optimizer.zero_grad()
            backend.print(f"pass {i} ({form}): loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
