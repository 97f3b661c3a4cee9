"""The GPU check's settings: its time budget, the backends and precisions it
covers, and how much each part runs on CUDA and in the CPU dry run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The command; the check's own helper processes (the host-sync worker under
#: each launcher, the Horovod build) are started through it too.
ENTRY = ROOT / "scripts" / "gpu_check.py"
#: The whole check, from the start of gpu_check.sh: the GPU machine gives 10
#: minutes a command, so 8 leave room for its start and the transfers.
BUDGET_S = 480.0
#: Kept free at the end for writing the report.
RESERVE_S = 10.0
SECTIONS = ("install", "environment", "recipes", "throughput", "host-sync")
#: Every backend the recipes run on; the in-process ones (single, dp) start one process.
BACKENDS = ("single", "dp", "ddp", "deepspeed", "horovod")
#: The backend options each recipe run adds (DeepSpeed: ZeRO-2 shards gradients and optimizer state).
BACKEND_ARGS: dict[str, tuple[str, ...]] = {"deepspeed": ("--zero-stage", "2")}
#: Backends whose training loop the host-sync section measures.
SYNC_BACKENDS = ("single", "ddp", "deepspeed", "horovod")
#: Precisions the throughput section measures: the same-process worker's
#: extra arguments for each, or None while parallelx has no such option (the
#: report then says so).  Adding bf16 once parallelx has it is this one line.
PRECISIONS: dict[str, tuple[str, ...] | None] = {
    "fp32": (),
    "bf16-mixed": ("--precision", "bf16-mixed"),
}
#: The parallelx step may synchronise with the host this many times per step
#: more than the plain framework's: 0.1 is expected (the progress bar reads
#: the loss every 10th step on the main rank); once per step would be 1.
SYNC_EXCESS_LIMIT = 0.5
HOROVOD_CHECKS_S = 100.0  # what the Horovod recipes and loop need once it is built


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How much each part runs: on CUDA, and in the CPU dry run (which CI runs: about 1.5 minutes on 2 cores)."""

    cuda: bool
    cifar_train: int
    cifar_test: int  # odd: two ranks must pad their shards
    dogcat_per_class: int
    cifar_args: tuple[str, ...]
    dogcat_args: tuple[str, ...]
    dogcat_size: int
    #: Backends each recipe runs on; the others are listed as skipped, with ``fewer_because``.
    recipe_backends: dict[str, tuple[str, ...]]
    fewer_because: str
    #: The reported val loss against best.pth's: on the CPU the same float
    #: arithmetic in another order; on GPUs cuDNN may also choose other
    #: kernels for other batch splits.
    loss_rtol: float
    launch_timeout_s: float
    model: str  # throughput: workload model, image size, batch per process, steps per block, blocks
    image_size: int
    batch: int
    warmup: int
    steps: int
    blocks: int
    sync_batch: int
    sync_steps: tuple[int, int, int]  # warm-up, short, long: per-step figures are (long - short) differences
    sync_workers: int
    sync_backends: tuple[str, ...]


CUDA = Settings(cuda=True, cifar_train=2000, cifar_test=501, dogcat_per_class=20,
                cifar_args=("--batch-size", "64"),
                dogcat_args=("--image-size", "224", "--batch-size", "8", "--max-steps", "3", "--lr", "0.001"),
                dogcat_size=224, recipe_backends={"cifar10": BACKENDS, "dogcat": BACKENDS}, fewer_because="",
                loss_rtol=1e-4, launch_timeout_s=180,
                model="vgg16", image_size=224, batch=32, warmup=2, steps=10, blocks=6,
                sync_batch=256, sync_steps=(5, 10, 60), sync_workers=4, sync_backends=SYNC_BACKENDS)
DRY_RUN = Settings(cuda=False, cifar_train=300, cifar_test=51, dogcat_per_class=13,
                   cifar_args=("--batch-size", "32"),
                   dogcat_args=("--image-size", "32", "--batch-size", "4", "--max-steps", "2", "--lr", "0.001"),
                   dogcat_size=32, loss_rtol=1e-5, launch_timeout_s=150,
                   # Near a minute and a half on 2 cores: dp is single on the CPU (no GPUs to split over),
                   # and VGG16 goes through one launch; every backend runs both recipes in the tests.
                   recipe_backends={"cifar10": ("single", "ddp", "deepspeed", "horovod"), "dogcat": ("single",)},
                   fewer_because="dry run: on the CPU dp runs as single, and VGG16 runs on one backend only, "
                                 "to keep the dry run short (tests/test_recipes.py runs them all)",
                   model="lenet", image_size=32, batch=32, warmup=1, steps=3, blocks=2,
                   sync_batch=32, sync_steps=(1, 2, 6), sync_workers=0, sync_backends=("ddp",))
