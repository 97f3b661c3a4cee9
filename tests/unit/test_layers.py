"""The package's shape, checked: layers without import circles, backend
knowledge only in backends/.

Read from the source (ast), so it needs no import and no subprocess."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Bottom to top: a module may import its own layer's and lower layers' modules only.
LAYERS: list[set[str]] = [
    {"errors", "log", "utils", "version", "watchdog", "batchnorm"},
    {
        "settings",
        "state",
        "launch",
        "runner",
        "environments",
        "precision",
        "network",
        "collectives",
        "units",
        "throughput",
        "profiling",
    },
    {
        "checkpoint",
        "sampler",
        "metrics",
        "buffers",
        "loop",
        "gather",
        "elastic",
        "sharded",
        "gradsync",
        "stateio",
        "compiling",
        "activations",
        "lockstep",
        "tracking",
        "checkprobe",
        "virtualworld",
    },
    {"protocol"},
    {"local", "process_group", "trainstate", "preempt", "main_process"},
    {"registry"},
    {"cli", "envreport", "backends", "ray", "check", "testing"},
    {"__init__", "__main__"},
]
#: Packages a module may import inside a function: the optional heavy ones.
HEAVY = ("deepspeed", "horovod", "torch.distributed", "torchvision", "psutil", "matplotlib", "pandas", "ray")
HEAVY += ("torch.utils.tensorboard", "mlflow", "wandb")  # the trackers' packages (parallelx/tracking/)
HEAVY += ("torch.utils.flop_counter",)  # it imports triton where torch has it: only when FLOPs are counted


def modules() -> dict[str, Path]:
    """``layer name`` -> file, for parallelx/ (environments/ counts as one module) and backends/."""
    found = {}
    for path in sorted((ROOT / "parallelx").rglob("*.py")):
        rel = path.relative_to(ROOT / "parallelx")
        found[f"parallelx/{rel}"] = path
    for path in sorted((ROOT / "backends").glob("*.py")):
        found[f"backends/{path.name}"] = path
    return found


def layer_of(key: str) -> str:
    if key.startswith("backends/"):
        return "backends"
    rel = key.removeprefix("parallelx/")
    return rel.split("/")[0] if "/" in rel else rel.removesuffix(".py")


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def imports(path: Path, key: str) -> tuple[set[str], list[str]]:
    """The package layers ``path`` imports at run time, and its function-local imports."""
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_nodes(tree)
    local_nodes = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }
    package = key.removeprefix("parallelx/").split("/")[:-1]
    targets: set[str] = set()
    local: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if key.startswith("parallelx/") else ["backends"]
            parts = [*base, *(node.module.split(".") if node.module else [])]
            names = [parts[0] if parts else a.name for a in node.names]
            mods = [".".join(["parallelx", *parts])] if parts else [f"parallelx.{n}" for n in names]
        else:
            mods = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module == "parallelx":
                mods = [f"parallelx.{a.name}" for a in node.names]
        for mod in filter(None, mods):
            if id(node) in local_nodes:
                local.append(mod)
            if mod.startswith("parallelx.backends"):
                targets.add("backends")
            elif mod.startswith("parallelx."):
                targets.add(mod.split(".")[1])
            elif mod == "parallelx":
                targets.add("__init__")
    targets.discard(layer_of(key))
    return targets, local


def test_imports_follow_the_layers_and_have_no_circle():
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    graph: dict[str, set[str]] = {}
    wrong = []
    for key, path in modules().items():
        me = layer_of(key)
        assert me in rank, f"{key}: give it a layer in LAYERS"
        targets, _ = imports(path, key)
        graph.setdefault(me, set()).update(targets)
        for t in targets:
            assert t in rank, f"{key} imports parallelx.{t}, which has no layer"
            if rank[t] > rank[me]:
                wrong.append(f"{key} (layer {rank[me]}) imports {t} (layer {rank[t]})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)
    # And no circle at all, whatever the layers say.
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import circle: {' -> '.join([*trail, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_function_local_imports_are_only_for_heavy_optional_packages():
    offenders = []
    for key, path in modules().items():
        _, local = imports(path, key)
        offenders += [f"{key}: {m}" for m in local if not m.startswith(HEAVY)]
    assert not offenders, "import these at the top of the module:\n" + "\n".join(offenders)


def test_no_backend_knowledge_outside_backends():
    """Backend names in comparisons, and backend-specific attributes, belong in backends/."""
    names = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](ddp|horovod|deepspeed|dp|single|fsdp)["']""")
    attributes = re.compile(r"""zero_stage|\.hvd\b|\.ds\.|getattr\((self\.)?backend\b|backend\._require_init""")
    offenders = []
    for folder in ("parallelx", "recipes", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for no, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if names.search(code) or attributes.search(code):
                    offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "backend knowledge belongs in backends/:\n" + "\n".join(offenders)


def test_the_checker_sees_a_circle(tmp_path):
    """The checks above can fail: fed a circle, the import reader reports both edges."""
    a = tmp_path / "a.py"
    a.write_text("from .b import x\n")
    assert imports(a, "parallelx/a.py")[0] == {"b"}
    f = tmp_path / "f.py"
    f.write_text("def g():\n    from .sampler import ShardedSampler\n")
    assert imports(f, "parallelx/f.py")[1] == ["parallelx.sampler"]


#: Underscore attributes of other objects that code outside backends/ may read, each with why.
PRIVATE_READS_ALLOWED = {
    ("os", "_exit"): "the watchdog ends a process whose waiting thread is inside C++ code",
    ("build_parser()", "_actions"): "argparse has no public list of a parser's options",
    ("torch.nn.modules.batchnorm", "_BatchNorm"): "torch has no public base class of its BatchNorm layers",
    # torch documents its CUDA memory snapshots through these two functions only ("Understanding CUDA Memory Usage").
    ("torch.cuda.memory", "_record_memory_history"): "torch's documented memory-snapshot API",
    ("torch.cuda.memory", "_dump_snapshot"): "torch's documented memory-snapshot API",
}


def private_reads(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls`` (dunders aside), by line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node.value)
        if owner in ("self", "cls", "super()") or (owner, name) in PRIVATE_READS_ALLOWED:
            continue
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner}.{name}")
    return found


def test_no_module_outside_backends_reads_private_names():
    """The loop, gathering, state and every other part call each other's public methods only."""
    offenders = [
        hit for folder in ("parallelx", "recipes") for p in (ROOT / folder).rglob("*.py") for hit in private_reads(p)
    ]
    assert not offenders, "private names read outside backends/ (use a part's public method):\n" + "\n".join(offenders)


def test_recipes_import_public_names_only():
    offenders = []
    for path in (ROOT / "recipes").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "parallelx":
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private or any(part.startswith("_") for part in node.module.split(".")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {private}")
            elif isinstance(node, ast.Import):
                offenders += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "parallelx" and any(p.startswith("_") for p in a.name.split("."))
                ]
    assert not offenders, "recipes/ must use parallelx's public API:\n" + "\n".join(offenders)


def test_the_private_read_check_sees_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g(backend, self):\n    backend._no_sync()\n    self._ok()\n    os._exit(1)\n")
    assert [hit.split(": ")[1] for hit in private_reads_in(f)] == ["backend._no_sync"]


def private_reads_in(path: Path) -> list[str]:
    """:func:`private_reads` for a file outside the repository."""
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        return private_reads(path)
    finally:
        ROOT = saved
