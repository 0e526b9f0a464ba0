"""The package is a house of layers (STYLE.md): imports only run downward.

1 runtime (process groups, checkpoint files, model unwrapping) < 2 builders (data, models,
criteria, optimizers, config) < 3 callbacks (and the recorders and LR schedules, which are
callbacks) < 4 engine (the loop, the trainer, launch) < 5 applications (pruning, deploy).
"""
import ast
import os

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "basetrainer")

# module-name prefix -> layer; the longest matching prefix wins
LAYERS = {
    "basetrainer.runtime": 1,
    "basetrainer.utils": 1,
    "basetrainer.utils.setup_config": 2,
    "basetrainer.dataloader": 2,
    "basetrainer.models": 2,
    "basetrainer.criterion": 2,
    "basetrainer.optimizer": 2,
    "basetrainer.callbacks": 3,
    "basetrainer.metric": 3,
    "basetrainer.scheduler": 3,
    "basetrainer.evaluation": 3,   # per-sample outputs in dataset order, their files, the report
    "basetrainer.engine": 4,
    "basetrainer.pruning": 5,
    # export and deployment; the original's entry points under engine/ and utils/ belong to it
    "basetrainer.deploy": 5,
    "basetrainer.tune": 5,   # hyperparameter search: runs the user's script once per trial
    "basetrainer.utils.converter": 5,
    **{f"basetrainer.engine.{rt}_engine": 5 for rt in ("onnx", "mnn", "ncnn", "openvino", "trt", "rknn")},
}


def layer_of(module):
    best = None
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return LAYERS[best] if best else None


def modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield (rel[: -len(".__init__")] if rel.endswith(".__init__") else rel), path


def is_module(name):
    path = os.path.join(ROOT, *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def imports_of(module, path):
    """Every basetrainer module imported anywhere in the file (function bodies too)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:   # "from basetrainer.runtime import comm" imports a module
                found.append((f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base, node.lineno))
    return [(name, line) for name, line in found if name.startswith("basetrainer")]


def test_every_module_has_a_layer():
    unplaced = [m for m, _ in modules() if m != "basetrainer" and layer_of(m) is None]
    assert not unplaced, f"modules outside the house: {unplaced}"


def test_imports_only_run_downward():
    upward = []
    for module, path in modules():
        if module == "basetrainer":        # the package's lazy public names sit above the house
            continue
        own = layer_of(module)
        for name, line in imports_of(module, path):
            target = layer_of(name)
            if target is not None and target > own:
                upward.append(f"{os.path.relpath(path, ROOT)}:{line} (layer {own}) imports {name} (layer {target})")
    assert not upward, "\n".join(upward)


def test_the_loop_knows_callbacks_only_through_the_base_class():
    path = os.path.join(PACKAGE, "engine", "engine.py")
    callback_modules = {name for name, _ in imports_of("basetrainer.engine.engine", path) if layer_of(name) == 3}
    assert callback_modules <= {"basetrainer.callbacks.callbacks"}, callback_modules


def test_the_loop_stays_short():
    with open(os.path.join(PACKAGE, "engine", "engine.py"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 300


def test_one_atomic_writer():
    """Files are written by rename in one place only (the runtime layer's atomic writer)."""
    offenders = []
    for module, path in modules():
        if module.startswith("basetrainer.runtime"):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        offenders += [f"{module}: {call}" for call in ("os.replace(", "os.rename(", "torch.save(") if call in text]
    assert not offenders, offenders


def test_no_import_cycles():
    """No module imports, through others, a module that imports it (function bodies count too):
    within a layer the house's order must also run one way, or each of the two can only be read
    with the other (measured: runtime.checkpoint and runtime.sharded imported each other)."""
    graph = {module: {name for name, _ in imports_of(module, path) if name != module} for module, path in modules()}
    cycles = []
    for start in sorted(graph):
        path, seen = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:   # depth first from start; a path back to start is a cycle (reported once: from its first module)
            name = next(stack[-1], None)
            if name is None:
                stack.pop()
                path.pop()
            elif name == start:
                cycles.append(" -> ".join(path + [start]))
            elif name in graph and name not in seen and name > start:
                seen.add(name)
                path.append(name)
                stack.append(iter(sorted(graph[name])))
    assert not cycles, "\n".join(cycles)


# torch's private fields basetrainer once reached into (a module's buffer dict, a DataLoader's
# iterator and its worker shutdown, a private base class); where torch gives no public way,
# one function touches them and its docstring says why
TORCH_PRIVATE = {"_buffers", "_non_persistent_buffers_set", "_NormBase", "_iterator", "_shutdown_workers",
                 "_persistent_workers"}
TORCH_PRIVATE_HOMES = {("basetrainer.engine.preemption", "_stop_workers")}


def test_torch_private_fields_only_in_their_one_function():
    def visit(node, module, function, found):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        named = node.attr if isinstance(node, ast.Attribute) else (
            node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
        if named in TORCH_PRIVATE and (module, function) not in TORCH_PRIVATE_HOMES:
            found.append(f"{module}:{node.lineno} ({function}) {named}")
        for child in ast.iter_child_nodes(node):
            visit(child, module, function, found)

    found = []
    for module, path in modules():
        with open(path, encoding="utf-8") as f:
            visit(ast.parse(f.read(), path), module, None, found)
    assert not found, "\n".join(found)
    for module, function in TORCH_PRIVATE_HOMES:   # each home says why torch has no public way
        with open(os.path.join(ROOT, *module.split(".")) + ".py", encoding="utf-8") as f:
            tree = ast.parse(f.read())
        home = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
        assert "no public way" in (ast.get_docstring(home) or ""), f"{module}.{function}: say why in its docstring"
