"""The engine's subpackages import one way (docs/ARCHITECTURE.md): a package imports only the
packages below it in LAYERS, so the engine process never depends on its clients and memory never
depends on the runner that uses it."""

from __future__ import annotations

import ast
import pathlib

import engine

# Lowest first. config, errors, request and limits are the shared vocabulary of every process.
LAYERS = [
    "config", "errors", "request", "limits", "parallel", "kernels", "attention", "models", "decode", "memory", "weights",
    "runner", "core", "client",
]  # fmt: skip
ROOT = pathlib.Path(engine.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    """The engine packages (first component under engine.) that `path` imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found |= {n.split(".")[1] for n in names if n.startswith("engine.")}
    return found


def test_every_engine_module_belongs_to_a_known_layer() -> None:
    tops = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if not p.name.startswith("__")}
    tops.discard("demo_model")  # the embedded test/demo checkpoint: imports nothing of the engine
    assert tops == set(LAYERS), f"update LAYERS and docs/ARCHITECTURE.md: {sorted(tops ^ set(LAYERS))}"


def test_packages_import_only_the_layers_below_them() -> None:
    wrong = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        layer = rel[0] if len(rel) > 1 else path.stem
        if layer not in LAYERS:
            continue
        for dep in _imports(path) - {layer}:
            if dep in LAYERS and LAYERS.index(dep) > LAYERS.index(layer):
                wrong.append(f"{path.relative_to(ROOT.parent)} imports engine.{dep}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_every_subpackage_says_what_lives_there_and_which_process_runs_it() -> None:
    for pkg in (p for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
        if pkg.name in ("attention", "models", "kernels", "decode"):  # libraries: their docstrings say what they hold
            assert doc, f"engine/{pkg.name}/__init__.py has no docstring"
            continue
        assert "process" in doc.lower() and all(
            f"`{m.name}`" in doc for m in pkg.glob("*.py") if m.name != "__init__.py"
        ), f"engine/{pkg.name}/__init__.py must name its process and every module in it"


def test_the_code_paths_the_docs_name_exist() -> None:
    """docs/ARCHITECTURE.md, README.md and bench/README.md stay true when files move: every
    `*.py` path they name exists (ARCHITECTURE's short paths are relative to engine/)."""
    import re

    repo = ROOT.parent
    missing = []
    for doc in ("docs/ARCHITECTURE.md", "docs/KERNELS.md", "README.md", "bench/README.md"):
        text = (repo / doc).read_text()
        for path in set(re.findall(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.py)\b", text)):
            if not ((repo / path).exists() or (ROOT / path).exists()):
                missing.append(f"{doc}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(sorted(missing))


def _module_imports(path: pathlib.Path) -> set[str]:
    """The engine modules `path` imports, by dotted name (`from engine.x import y` names
    engine.x.y where that is a module), lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("engine.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                as_module = ROOT.parent / (sub.replace(".", "/") + ".py")
                found.add(sub if as_module.exists() else node.module)
    return found


def test_no_two_engine_modules_import_each_other_even_through_others() -> None:
    """The module graph has no cycle (TYPE_CHECKING and lazy imports count: a cycle there is a
    design that only works by accident)."""
    modules = {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in ROOT.rglob("*.py")
    }
    graph = {m: {d for d in _module_imports(p) if d in modules and d != m and not m.startswith(d + ".")} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_triton_kernels_live_in_the_kernels_package_and_know_no_modules() -> None:
    """Every `@triton.jit` is in engine/kernels/; a kernel module takes tensors and shapes, never
    a torch.nn module (its callers in models/, decode/, attention/ and runner/ pass tensors)."""
    outside, with_modules = [], []
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        in_kernels = path.parent.name == "kernels"
        if "triton.jit" in text and not in_kernels:
            outside.append(str(path.relative_to(ROOT.parent)))
        if in_kernels and ("from torch import nn" in text or "torch.nn." in text.replace("torch.nn.functional", "")):
            with_modules.append(str(path.relative_to(ROOT.parent)))
    assert not outside, f"@triton.jit outside engine/kernels/: {outside}"
    assert not with_modules, f"kernel modules that know torch.nn modules: {with_modules}"


def test_the_engine_and_the_server_read_no_environment_switch_of_their_own() -> None:
    """Every choice is an EngineConfig field and a `siesta serve` flag: no SIESTA_* variable is
    read under engine/ or server/ (other projects' variables, HF_HOME or PROMETHEUS_MULTIPROC_DIR,
    are theirs)."""
    import re

    found = []
    for path in [*ROOT.rglob("*.py"), *(ROOT.parent / "server").rglob("*.py")]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"[\"']SIESTA_\w+[\"']", line):
                found.append(f"{path.relative_to(ROOT.parent)}:{i}: {line.strip()}")
    assert not found, "environment switches of our own:\n" + "\n".join(found)
