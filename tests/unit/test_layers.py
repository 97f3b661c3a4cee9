"""The package's shape, checked: the folders are the layers, no import circle
(type-only imports counted), backend knowledge only in backends/.

Read from the source (ast), so it needs no import and no subprocess."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Bottom to top: a package (or top-level module) may import its own and lower layers only.
#: docs/protocol.md's table of the tree follows this list.
LAYERS: list[set[str]] = [
    {"errors", "log", "utils", "version", "_compat"},
    {"settings", "transforms", "storage"},  # timeouts, devices; around wrapping; where checkpoint files live
    {"launching", "forensics"},  # where the ranks come from, how processes start; what each rank was doing
    {"parts", "bigmodels"},  # collectives, gradient sync, ..., the loop, the sampler; weights in and out
    {"observability", "tensor_parallel"},  # the monitor, throughput, profiles, trackers; splitting layers over ranks
    {"strategy"},  # what a backend author subclasses
    {"backend"},  # the facade users call
    {"strategies", "training", "checkpoints"},  # strategy bases; helpers over the facade; training-state files
    {"registry"},
    {"cli", "check", "backends", "testing"},
    {"__init__", "__main__"},
]
#: Packages a module may import inside a function: the optional heavy ones.
HEAVY = ("deepspeed", "horovod", "torch.distributed", "torchvision", "psutil", "matplotlib", "pandas", "ray")
HEAVY += ("torch.utils.tensorboard", "mlflow", "wandb")  # the trackers' packages (observability/trackers/)
HEAVY += ("torch._inductor",)  # compile's options: only when a model is compiled
HEAVY += ("torch.utils.flop_counter",)  # it imports triton where torch has it: only when FLOPs are counted
HEAVY += ("safetensors", "transformers", "huggingface_hub")  # big-model formats, where a user has them
HEAVY += ("fsspec", "s3fs")  # object stores (parallelx/storage.py): the s3 extra, only for a URL
#: No folder of parallelx/ holds more modules than this (a newcomer reads a folder's names at a glance).
MOST_MODULES = 15


def modules() -> dict[str, Path]:
    """``parallelx/<path>`` or ``backends/<name>`` -> file."""
    found = {}
    for path in sorted((ROOT / "parallelx").rglob("*.py")):
        rel = path.relative_to(ROOT / "parallelx")
        found[f"parallelx/{rel}"] = path
    for path in sorted((ROOT / "backends").glob("*.py")):
        found[f"backends/{path.name}"] = path
    return found


def layer_of(key: str) -> str:
    """The layer a file belongs to: its top-level package, or its own name for a top-level module."""
    if key.startswith("backends/"):
        return "backends"
    rel = key.removeprefix("parallelx/")
    return rel.split("/")[0] if "/" in rel else rel.removesuffix(".py")


def module_name(key: str) -> str:
    """``parallelx/parts/loop.py`` -> ``parallelx.parts.loop`` (a file of backends/ -> ``parallelx.backends.<name>``)."""
    if key.startswith("backends/"):
        key = "parallelx/" + key
    name = key.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def imports(path: Path, key: str) -> tuple[set[str], list[str], set[str]]:
    """The layers ``path`` imports (type-only imports included: a circle of types is a circle of
    design), its function-local imports, and the parallelx modules it names."""
    tree = ast.parse(path.read_text())
    local_nodes = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }
    package = module_name(key).split(".")
    if not key.endswith("__init__.py"):
        package = package[:-1]
    targets: set[str] = set()
    named: set[str] = set()
    local: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - (node.level - 1)], *([base] if base else [])])
            # `from pkg import name` names pkg.name where that is a module, else pkg itself.
            mods = [f"{base}.{a.name}" for a in node.names] if base.startswith("parallelx") else [base]
        else:
            mods = [a.name for a in node.names]
        for mod in filter(None, mods):
            if id(node) in local_nodes:
                local.append(mod)
            if not (mod == "parallelx" or mod.startswith("parallelx.")):
                continue
            parts = mod.split(".")
            if len(parts) > 1 and parts[1] == "backends":
                targets.add("backends")
            elif len(parts) > 1 and (
                (ROOT / "parallelx" / parts[1]).exists() or (ROOT / "parallelx" / f"{parts[1]}.py").exists()
            ):
                targets.add(parts[1])
            else:
                targets.add("__init__")
            named.add(mod)
    targets.discard(layer_of(key))
    return targets, local, named


def _no_circle(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import circle between {what}: {' -> '.join([*trail, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_imports_follow_the_layers_and_have_no_circle():
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    graph: dict[str, set[str]] = {}
    wrong = []
    for key, path in modules().items():
        me = layer_of(key)
        assert me in rank, f"{key}: give it a layer in LAYERS"
        targets, _, _ = imports(path, key)
        graph.setdefault(me, set()).update(targets)
        for t in targets:
            assert t in rank, f"{key} imports parallelx.{t}, which has no layer"
            if rank[t] > rank[me]:
                wrong.append(f"{key} (layer {rank[me]}) imports {t} (layer {rank[t]})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)
    _no_circle(graph, "packages")  # and none at all, whatever the layers say


def test_modules_have_no_import_circle():
    """Inside a package too: no module imports one that imports it back (type-only imports counted)."""
    found = modules()
    names = {module_name(k): k for k in found}
    graph: dict[str, set[str]] = {}
    for key, path in found.items():
        _, _, named = imports(path, key)
        me = module_name(key)
        # `from parallelx.parts import loop` names parallelx.parts.loop; a package's __init__ is its own node.
        graph[me] = {m for m in named if m in names and m != me and not me.startswith(m + ".")}
    _no_circle(graph, "modules")


def test_the_tree_reads_at_a_glance():
    """No two modules share a name, and no folder holds more than MOST_MODULES modules."""
    files = list((ROOT / "parallelx").rglob("*.py"))
    names = Counter(p.name for p in files if p.name not in ("__init__.py", "__main__.py"))
    assert not [n for n, c in names.items() if c > 1], (
        f"modules that share a name: {[n for n, c in names.items() if c > 1]}"
    )
    per_folder = Counter(p.parent.relative_to(ROOT) for p in files)
    crowded = {str(k): v for k, v in per_folder.items() if v > MOST_MODULES}
    assert not crowded, f"folders over {MOST_MODULES} modules: {crowded}"


def test_function_local_imports_are_only_for_heavy_optional_packages():
    offenders = []
    for key, path in modules().items():
        _, local, _ = imports(path, key)
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
    """The checks above can fail: fed a circle, the import reader reports both edges, type-only ones too."""
    (tmp_path / "a.py").write_text("from .backend import x\n")
    assert imports(tmp_path / "a.py", "parallelx/a.py")[0] == {"backend"}
    (tmp_path / "t.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from parallelx.backend import B\n"
    )
    assert imports(tmp_path / "t.py", "parallelx/parts/t.py")[0] == {"backend"}
    f = tmp_path / "f.py"
    f.write_text("def g():\n    from .sampler import ShardedSampler\n")
    assert imports(f, "parallelx/parts/f.py")[1] == ["parallelx.parts.sampler.ShardedSampler"]
    try:
        _no_circle({"a": {"b"}, "b": {"a"}}, "test")
    except AssertionError as exc:
        assert "a -> b -> a" in str(exc)
    else:
        raise AssertionError("a circle went unseen")


#: Underscore attributes of other objects that code outside backends/ may read, each with why.
PRIVATE_READS_ALLOWED = {
    ("os", "_exit"): "the watchdog ends a process whose waiting thread is inside C++ code",
    ("build_parser()", "_actions"): "argparse has no public list of a parser's options",
    # add_arguments skips an option the script's own parser already has (the script's wins): the same gap.
    ("self._parser", "_actions"): "argparse has no public list of a parser's options",
    ("self._parser", "_option_string_actions"): "argparse has no public table of a parser's option strings",
    ("torch.nn.modules.batchnorm", "_BatchNorm"): "torch has no public base class of its BatchNorm layers",
    # torch documents its CUDA memory snapshots through these two functions only ("Understanding CUDA Memory Usage").
    ("torch.cuda.memory", "_record_memory_history"): "torch's documented memory-snapshot API",
    ("torch.cuda.memory", "_dump_snapshot"): "torch's documented memory-snapshot API",
    ("sys", "_current_frames"): "the only way to read another thread's stack (a rank's main thread, for its verdict)",
    ("dist.distributed_c10d", "_get_default_store"): "torch has no public accessor of the rendezvous store",
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
