"""pytorch/examples' ImageNet training script, ported to parallelx the way the
README shows: the same file runs under python, torchrun, horovodrun and the
deepspeed launcher.

    torchrun --nproc-per-node 2 tests/support/clients/imagenet_port.py DATA --image-size 32 --seed 0
    horovodrun -np 2 python tests/support/clients/imagenet_port.py DATA --image-size 32 --seed 0
    deepspeed --num_gpus 2 tests/support/clients/imagenet_port.py DATA --image-size 32 --seed 0 --zero-stage 3

DATA holds ``train/`` and ``val/`` in ImageFolder's layout (one folder per class).

What a user changes from the original: the backend's argparse options (in place
of ``--world-size``, ``--rank``, ``--dist-url``, ``--dist-backend``, ``--gpu``
and ``--multiprocessing-distributed``: the launcher says how many processes),
``with backend``, ``backend.setup``, a sharded sampler for each loader,
``backend.batches`` / ``backend.backward`` / ``backend.step`` in the training
loop, validation figures summed over the ranks with ``MetricSums`` (exact: no
``drop_last`` and no second loader for the remainder), ``backend.save`` and
``backend.load`` for the checkpoints.  Kept: the augmentation in the
DataLoader's worker processes, the StepLR schedule stepped once per epoch, the
meters, ``--resume``, ``--evaluate``, ``--dummy``.  Added so that it runs on a
few CPU cores: ``--image-size`` (224), the class count taken from the data
(``--num-classes`` for ``--dummy``), ``--dummy-size``, ``--checkpoint-dir``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
import warnings
from enum import Enum

import torch
import torch.nn as nn
import torch.utils.data
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.optim.lr_scheduler import StepLR

import parallelx

model_names = sorted(
    name for name in models.__dict__ if name.islower() and not name.startswith("__") and callable(models.__dict__[name])
)

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("data", metavar="DIR", nargs="?", default="imagenet", help="path to dataset (default: imagenet)")
parser.add_argument(
    "-a",
    "--arch",
    metavar="ARCH",
    default="resnet18",
    choices=model_names,
    help="model architecture: " + " | ".join(model_names) + " (default: resnet18)",
)
parser.add_argument(
    "-j", "--workers", default=4, type=int, metavar="N", help="number of data loading workers (default: 4)"
)
parser.add_argument("--epochs", default=90, type=int, metavar="N", help="number of total epochs to run")
parser.add_argument("--start-epoch", default=0, type=int, metavar="N", help="manual epoch number (useful on restarts)")
parser.add_argument(
    "-b",
    "--batch-size",
    default=256,
    type=int,
    metavar="N",
    help="mini-batch size per process (default: 256); the global batch is this times the processes",
)
parser.add_argument(
    "--lr", "--learning-rate", default=0.1, type=float, metavar="LR", help="initial learning rate", dest="lr"
)
parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
parser.add_argument(
    "--wd",
    "--weight-decay",
    default=1e-4,
    type=float,
    metavar="W",
    help="weight decay (default: 1e-4)",
    dest="weight_decay",
)
parser.add_argument("-p", "--print-freq", default=10, type=int, metavar="N", help="print frequency (default: 10)")
parser.add_argument("--resume", default="", type=str, metavar="PATH", help="path to latest checkpoint (default: none)")
parser.add_argument("-e", "--evaluate", dest="evaluate", action="store_true", help="evaluate model on validation set")
parser.add_argument("--pretrained", dest="pretrained", action="store_true", help="use pre-trained model")
parser.add_argument("--seed", default=None, type=int, help="seed for initializing training. ")
parser.add_argument("--dummy", action="store_true", help="use fake data to benchmark")
# Sizes, so that it also runs on a few CPU cores.
parser.add_argument("--image-size", default=224, type=int, metavar="PX", help="training crop size (default: 224)")
parser.add_argument(
    "--num-classes",
    default=None,
    type=int,
    metavar="N",
    help="classes of --dummy data (default: 1000); with real data, the folders of train/",
)
parser.add_argument(
    "--dummy-size",
    default=[1281167, 50000],
    type=int,
    nargs=2,
    metavar=("TRAIN", "VAL"),
    help="samples of --dummy data (default: ImageNet's 1281167 50000)",
)
parser.add_argument(
    "--checkpoint-dir", default=".", metavar="DIR", help="where checkpoint.pth.tar and model_best.pth.tar go"
)
parallelx.add_arguments(parser)

best_acc1 = 0.0


def main():
    args = parser.parse_args()

    if args.seed is not None:
        # The same seed on every rank: the same initial weights, the same augmentation draws.
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        warnings.warn(
            "You have chosen to seed training. "
            "This will turn on the CUDNN deterministic setting, "
            "which can slow down your training considerably! "
            "You may see unexpected behavior when restarting "
            "from checkpoints.",
            stacklevel=1,
        )

    with parallelx.from_args(args) as backend:
        main_worker(backend, args)


def main_worker(backend, args):
    global best_acc1
    device = backend.device

    # Data loading code (before the model: its class count comes from the data)
    if args.dummy:
        backend.print("=> Dummy data is used!")
        num_classes = args.num_classes or 1000
        shape = (3, args.image_size, args.image_size)
        train_dataset = datasets.FakeData(args.dummy_size[0], shape, num_classes, transforms.ToTensor())
        val_dataset = datasets.FakeData(args.dummy_size[1], shape, num_classes, transforms.ToTensor())
    else:
        traindir = os.path.join(args.data, "train")
        valdir = os.path.join(args.data, "val")
        normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])

        train_dataset = datasets.ImageFolder(
            traindir,
            transforms.Compose(
                [
                    transforms.RandomResizedCrop(args.image_size),
                    transforms.RandomHorizontalFlip(),
                    transforms.ToTensor(),
                    normalize,
                ]
            ),
        )

        val_dataset = datasets.ImageFolder(
            valdir,
            transforms.Compose(
                [
                    transforms.Resize(args.image_size * 256 // 224),
                    transforms.CenterCrop(args.image_size),
                    transforms.ToTensor(),
                    normalize,
                ]
            ),
        )
        num_classes = len(train_dataset.classes)

    # create model
    if args.pretrained:
        backend.print(f"=> using pre-trained model '{args.arch}'")
        model = models.__dict__[args.arch](weights="DEFAULT")
    else:
        backend.print(f"=> creating model '{args.arch}'")
        model = models.__dict__[args.arch](num_classes=num_classes)

    # define loss function (criterion), optimizer, and learning rate scheduler
    criterion = nn.CrossEntropyLoss().to(device)

    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model, optimizer = backend.setup(model, optimizer)

    # Sets the learning rate to the initial LR decayed by 10 every 30 epochs
    scheduler = StepLR(optimizer, step_size=30, gamma=0.1)

    # optionally resume from a checkpoint
    if args.resume:
        if os.path.isfile(args.resume):
            backend.print(f"=> loading checkpoint '{args.resume}'")
            checkpoint = backend.load(args.resume)
            args.start_epoch = checkpoint["epoch"]
            best_acc1 = checkpoint["best_acc1"]
            backend.load_state_dict(model, checkpoint["state_dict"])
            backend.load_state_dict(optimizer, checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            backend.print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")
        else:
            backend.print(f"=> no checkpoint found at '{args.resume}'")

    train_sampler = backend.make_sampler(train_dataset, shuffle=True, seed=args.seed or 0)
    val_sampler = backend.make_sampler(val_dataset, shuffle=False)

    pin_memory = device.type == "cuda"
    train_loader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=pin_memory,
        sampler=train_sampler,
    )

    val_loader = torch.utils.data.DataLoader(
        val_dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=pin_memory,
        sampler=val_sampler,
    )

    if args.evaluate:
        validate(val_loader, model, criterion, backend, args)
        return

    for epoch in range(args.start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)

        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch, backend, args)

        # evaluate on validation set
        acc1 = validate(val_loader, model, criterion, backend, args)

        scheduler.step()

        # remember best acc@1 and save checkpoint
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)

        save_checkpoint(
            backend,
            {
                "epoch": epoch + 1,
                "arch": args.arch,
                "state_dict": model,
                "best_acc1": best_acc1,
                "optimizer": optimizer,
                "scheduler": scheduler.state_dict(),
            },
            is_best,
            args.checkpoint_dir,
        )


def train(train_loader, model, criterion, optimizer, epoch, backend, args):
    batch_time = AverageMeter("Time", ":6.3f")
    data_time = AverageMeter("Data", ":6.3f")
    losses = AverageMeter("Loss", ":.4e")
    top1 = AverageMeter("Acc@1", ":6.2f")
    top5 = AverageMeter("Acc@5", ":6.2f")
    progress = ProgressMeter(
        len(train_loader), [batch_time, data_time, losses, top1, top5], backend, prefix=f"Epoch: [{epoch}]"
    )

    # switch to train mode
    model.train()

    end = time.time()
    for i, (images, target) in enumerate(backend.batches(train_loader)):
        # measure data loading time
        data_time.update(time.time() - end)

        # move data to the same device as model
        images = images.to(backend.device, non_blocking=True)
        target = target.to(backend.device, non_blocking=True)

        # compute output
        with backend.autocast():
            output = model(images)
            loss = criterion(output, target)

        # measure accuracy and record loss (this rank's batches)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))

        # compute gradient and do SGD step (zero_grad at the step, on every backend)
        backend.backward(loss)
        backend.step(optimizer)

        # measure elapsed time
        batch_time.update(time.time() - end)
        end = time.time()

        if i % args.print_freq == 0:
            progress.display(i + 1)


def validate(val_loader, model, criterion, backend, args):
    def run_validate(loader, base_progress=0):
        # Every rank's figures, each validation image counted once: MetricSums leaves the
        # sampler's padding out.  (The meters below are this rank's, for the progress lines.)
        sums1 = parallelx.MetricSums(loader.sampler)
        sums5 = parallelx.MetricSums(loader.sampler)
        with torch.no_grad():
            end = time.time()
            for i, (images, target) in enumerate(loader):
                i = base_progress + i
                images = images.to(backend.device, non_blocking=True)
                target = target.to(backend.device, non_blocking=True)

                # compute output
                with backend.autocast():
                    output = model(images)
                    per_sample = nn.functional.cross_entropy(output, target, reduction="none")
                loss = per_sample.mean()

                # measure accuracy and record loss
                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                losses.update(loss.item(), images.size(0))
                top1.update(acc1[0], images.size(0))
                top5.update(acc5[0], images.size(0))
                correct1, correct5 = correct_k(output, target, topk=(1, 5))
                sums1.update(per_sample, correct1)
                sums5.update(per_sample, correct5)

                # measure elapsed time
                batch_time.update(time.time() - end)
                end = time.time()

                if i % args.print_freq == 0:
                    progress.display(i + 1)
        return sums1.compute(backend), sums5.compute(backend)  # collectives: every rank calls them

    batch_time = AverageMeter("Time", ":6.3f", Summary.NONE)
    losses = AverageMeter("Loss", ":.4e", Summary.NONE)
    top1 = AverageMeter("Acc@1", ":6.2f", Summary.AVERAGE)
    top5 = AverageMeter("Acc@5", ":6.2f", Summary.AVERAGE)
    progress = ProgressMeter(len(val_loader), [batch_time, losses, top1, top5], backend, prefix="Test: ")

    # switch to evaluate mode
    model.eval()

    m1, m5 = run_validate(val_loader)
    # The whole validation set's figures replace this rank's in the summary.
    losses.set_total(m1["loss"], m1["count"])
    top1.set_total(100.0 * m1["acc"], m1["count"])
    top5.set_total(100.0 * m5["acc"], m5["count"])

    progress.display_summary()

    return top1.avg


def save_checkpoint(backend, state, is_best, folder, filename="checkpoint.pth.tar"):
    path = os.path.join(folder, filename)
    backend.save(state, path)  # every rank: the model and optimizer are gathered; rank 0 writes
    if is_best and backend.is_main():
        shutil.copyfile(path, os.path.join(folder, "model_best.pth.tar"))


class Summary(Enum):
    NONE = 0
    AVERAGE = 1
    SUM = 2
    COUNT = 3


class AverageMeter:
    """Computes and stores the average and current value"""

    def __init__(self, name, fmt=":f", summary_type=Summary.AVERAGE):
        self.name = name
        self.fmt = fmt
        self.summary_type = summary_type
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def set_total(self, avg, count):
        """The figure over every rank (from MetricSums), in place of this rank's own."""
        self.sum, self.count = avg * count, count
        self.avg = avg

    def __str__(self):
        fmtstr = "{name} {val" + self.fmt + "} ({avg" + self.fmt + "})"
        return fmtstr.format(**self.__dict__)

    def summary(self):
        fmtstr = ""
        if self.summary_type is Summary.NONE:
            fmtstr = ""
        elif self.summary_type is Summary.AVERAGE:
            fmtstr = "{name} {avg:.3f}"
        elif self.summary_type is Summary.SUM:
            fmtstr = "{name} {sum:.3f}"
        elif self.summary_type is Summary.COUNT:
            fmtstr = "{name} {count:.3f}"
        else:
            raise ValueError(f"invalid summary type {self.summary_type!r}")

        return fmtstr.format(**self.__dict__)


class ProgressMeter:
    def __init__(self, num_batches, meters, backend, prefix=""):
        self.batch_fmtstr = self._get_batch_fmtstr(num_batches)
        self.meters = meters
        self.backend = backend
        self.prefix = prefix

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch)]
        entries += [str(meter) for meter in self.meters]
        self.backend.print("\t".join(entries))

    def display_summary(self):
        entries = [" *"]
        entries += [meter.summary() for meter in self.meters]
        self.backend.print(" ".join(entries))

    def _get_batch_fmtstr(self, num_batches):
        num_digits = len(str(num_batches // 1))
        fmt = "{:" + str(num_digits) + "d}"
        return "[" + fmt + "/" + fmt.format(num_batches) + "]"


def correct_k(output, target, topk=(1,)):
    """For each k, whether each sample's target is among its k top predictions (bool, [B])."""
    with torch.no_grad():
        maxk = min(max(topk), output.size(1))  # fewer classes than k: every class is among the top k
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [correct[:k].any(0) for k in topk]


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        batch_size = target.size(0)
        return [c.float().sum(0, keepdim=True).mul_(100.0 / batch_size) for c in correct_k(output, target, topk)]


if __name__ == "__main__":
    main()
