"""The house rules of megaloom's structure (issue 37), checked on the source text so that they hold for every
contributor: no import cycle between megaloom's modules, at load time and, but for the few
lookups listed in CALL_TIME_UP, at call time too; errors in one light module; and no family named outside
megaloom/models/ (FAMILY_NAMES_ALLOWED).

Import graph. Every ``megaloom/**/*.py`` is parsed with `ast`; an ``import`` / ``from ... import`` (relative ones
resolved against the importing module's package) that names a megaloom module is an edge. ``from P import n``
is an edge to ``P.n`` when that is a module, else to ``P`` (a name P's ``__init__`` defines, even when P encloses
the importer). Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, so those are edges too,
except the importer's own enclosing packages (Python is already importing them when the importer runs).

Which imports count:
- Module-level imports, including those under a module-level ``if`` / ``try`` / ``with`` and in class bodies:
  they run when the module loads, so a cycle among them is a load-time cycle (one module sees the other half
  built, or not at all, depending on which is imported first).
- Not imports inside functions: they run when the function is called, after every module has loaded. megaloom
  uses them on purpose where a module needs another only at call time (an optional package, a heavy one that a
  light command should not load); each says why in a comment.
- Not imports under ``if TYPE_CHECKING:``: they never run; annotations are strings (``from __future__ import
  annotations``) that only a type checker reads. A type-only dependency is not a load-time edge and must not
  force two modules into one layer. (An ``else:`` branch of such an ``if`` runs, and counts.)

Errors: every exception class megaloom raises lives in megaloom/errors.py, which imports nothing of megaloom's
and nothing heavy, so any layer can raise or catch one without importing another layer (ConfigError in config.py
and CheckpointError in checkpoint/store.py tied forty modules into one circle). Their old names are re-exports.

The second cycle test adds the imports inside functions: the layering itself. An import moved into a function to
dodge a load-time cycle leaves the two modules tangled, so it fails there, unless it is one of the
deliberate lookups up the layers in CALL_TIME_UP, each with its reason.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "megaloom"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt], functions: bool):
    """The import statements of ``body`` that run: at module level (``functions`` False) or anywhere (True);
    never those under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _imports(node.orelse, functions)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if functions:
                yield from _imports(node.body, functions)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _imports([child], functions)
                elif isinstance(child, ast.excepthandler | ast.match_case):
                    yield from _imports(child.body, functions)


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def import_graph(functions: bool = False) -> dict[str, set[str]]:
    """megaloom module -> the megaloom modules it imports (see the module docstring for what counts)."""
    mods = _modules()

    def owner(name: str) -> str | None:  # the module a dotted name lives in (a module, or an attribute of one)
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        named: set[str | None] = set()  # what the statements name: a module, or the package defining a name
        for node in _imports(_tree(path).body, functions):
            if isinstance(node, ast.Import):
                named.update(owner(a.name) for a in node.names)
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.startswith("megaloom"):
                named.update(f"{source}.{a.name}" if f"{source}.{a.name}" in mods else owner(source)
                             for a in node.names)
        named.discard(None)
        ancestors = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        parents = {p for t in named for i in range(1, t.count(".") + 1)  # a.b.c runs a/ and a/b/__init__ first
                   if (p := ".".join(t.split(".")[:i])) in mods}
        # an enclosing package is already being imported when ``mod`` runs: not a new edge unless named
        graph[mod] = (named | (parents - ancestors)) - {mod}
    return graph


def knots(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative): each module of
    one can reach every other, so they can only load as one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(set(comp))
    return found


def cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """One cycle inside a knot, to name in a failure: from its first module, the shortest path back to it."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def _report(graph: dict[str, set[str]], found: list[set[str]]) -> str:
    return "\n".join(f"{' -> '.join(cycle_in(graph, comp))}  (a knot of {len(comp)} modules: "
                     f"{', '.join(sorted(comp))})" for comp in found)


# Imports inside functions that reach up the layers on purpose: (importer, prefix of the modules it may import
# when called) -> why. Every other call-time import must go down, like the module-level ones.
# Empty today: the decoder built without its family (`Transformer(cfg)`) asks for it through the package's seam
# (`model_keys.base.model_rules().family`), not by importing the registry.
CALL_TIME_UP: dict[tuple[str, str], str] = {}


def _without_allowed(graph: dict[str, set[str]], load: dict[str, set[str]]) -> dict[str, set[str]]:
    out = {}
    for mod, targets in graph.items():
        out[mod] = {t for t in targets
                    if t in load[mod] or not any(mod == a and (t == b or t.startswith(b + "."))
                                                 for a, b in CALL_TIME_UP)}
    return out


def test_the_graph_sees_megaloom():
    """The parser finds the modules and the edges it should (a broken walk would pass every cycle test)."""
    graph = import_graph()
    assert len(graph) > 150
    assert "megaloom.models.family" in graph["megaloom.models.registry"]
    assert "megaloom.models.llama" in graph["megaloom.models.registry"]  # `from megaloom.models import llama`
    assert "megaloom.parallel" in graph["megaloom.training.records"]  # comm's package __init__ runs first
    assert "megaloom.errors" in graph["megaloom.config"]


def test_no_import_cycle_at_load_time():
    graph = import_graph()
    found = knots(graph)
    assert not found, "import cycles among megaloom's module-level imports:\n" + _report(graph, found)


def test_no_import_cycle_with_call_time_imports():
    load = import_graph()
    graph = _without_allowed(import_graph(functions=True), load)
    found = knots(graph)
    assert not found, ("import cycles once the imports inside functions are counted (an import moved into a "
                       "function to dodge a cycle; move code to the layer it belongs to instead):\n"
                       + _report(graph, found))


def test_call_time_lookups_are_still_needed():
    """Each CALL_TIME_UP entry is a call-time import that exists and would close a cycle: a stale entry goes."""
    load, full = import_graph(), import_graph(functions=True)
    for (mod, prefix), why in CALL_TIME_UP.items():
        lazy = {t for t in full[mod] - load[mod] if t == prefix or t.startswith(prefix + ".")}
        assert lazy, f"{mod} no longer imports {prefix} inside a function: remove its CALL_TIME_UP entry ({why})"
        alone = _without_allowed(full, load)
        alone[mod] |= lazy
        assert knots(alone), f"{mod} -> {prefix} closes no cycle any more: remove its CALL_TIME_UP entry"


def _base_names(node: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, ast.Name | ast.Attribute)}


def test_errors_live_in_one_light_module():
    errors_py = ROOT / "errors.py"
    tree = _tree(errors_py)
    ours = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert {"ConfigError", "CheckpointError", "DataError", "ConversionError", "RunStopped"} <= ours
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "pathlib"}, f"megaloom/errors.py must stay light; it imports {imported}"
    elsewhere = []
    for mod, (path, _) in _modules().items():
        if path == errors_py:
            continue
        for node in ast.walk(_tree(path)):
            bases = _base_names(node) if isinstance(node, ast.ClassDef) else set()
            if any(b.endswith(("Error", "Exception")) or b in ours for b in bases):
                elsewhere.append(f"{mod}.{node.name}")
    assert not elsewhere, f"exception classes outside megaloom/errors.py (define them there): {elsewhere}"


def test_old_error_names_are_the_same_classes():
    import megaloom.errors as errors
    from megaloom.checkpoint.store import CheckpointError, NoUsableCheckpoint, SaveFailed
    from megaloom.config import ConfigError
    from megaloom.convert.errors import ConversionError
    from megaloom.data.errors import DataError
    from megaloom.parallel.pipeline.schedules import ScheduleError
    from megaloom.resilience.peers import PeerLost
    from megaloom.resilience.rollbacks import Diverged
    from megaloom.resilience.run_lock import RunDirLocked, RunDirUnwritable
    from megaloom.training.checkpoints import DataChanged

    for cls in (CheckpointError, NoUsableCheckpoint, SaveFailed, ConfigError, ConversionError, DataError,
                ScheduleError, PeerLost, Diverged, RunDirLocked, RunDirUnwritable, DataChanged):
        assert getattr(errors, cls.__name__) is cls


# ------------------------------------------------------------------------------------- family names

# Code outside megaloom/models/ never names a model family: it asks the family (`get_family(arch)`: its traits,
# its Family fields) or the built module, so a new family is its folder and its registry line, and a lever or a
# rule never silently skips it. Checked on string literals (a name is how code outside models/ could test
# `model.arch`), case-insensitive, as whole words. Not checked: docstrings and comments, and the help texts of
# config keys (`_f(default, help)`), which are documentation a person reads (`megaloom config --list`); preset
# names (`llava-tiny`), which name a shape, not a family. convert/ is no exception: each family's Hugging Face
# mapping lives in its folder (`models/<family>/hf.py`) and convert/ finds it through the registry.
# (path under megaloom/, the literal's text) -> why that literal is not a reference to a family.
FAMILY_NAMES_ALLOWED = {
    ("model_keys/decoder.py", "llama"):
        "model.arch's default value (the default preset, tiny, is a llama too): a value, not a branch on a family",
}


def _documentation(tree: ast.Module) -> set[int]:
    """ids of the string nodes that are documentation: docstrings, and config fields' help (``_f(default, help)``)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_f":
            out.update(id(a) for a in node.args[1:2])
            out.update(id(k.value) for k in node.keywords if k.arg == "help")
    return out


def family_names_outside_models() -> list[tuple[str, int, str, str]]:
    """(path under megaloom/, line, family name, literal) for every string literal outside megaloom/models/ that
    names a registered family, but for documentation and preset names (see above)."""
    import re

    from megaloom.models.presets import PRESETS
    from megaloom.models.registry import FAMILIES

    word = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("models/"):
            continue
        tree = _tree(path)
        docs = _documentation(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
                continue
            for token in word.findall(node.value):
                if token.rstrip(".") in PRESETS:
                    continue
                for part in re.split(r"[._-]", token.lower()):
                    if part in FAMILIES:
                        found.append((rel, node.lineno, part, node.value))
    return sorted(set(found))


def test_no_family_is_named_outside_models():
    found = [f for f in family_names_outside_models() if (f[0], f[3]) not in FAMILY_NAMES_ALLOWED]
    assert not found, ("family names outside megaloom/models/ (ask the family's traits or fields instead; see "
                       "FAMILY_NAMES_ALLOWED for what is not a family reference):\n"
                       + "\n".join(f"megaloom/{rel}:{line}: {name!r} in {text!r}" for rel, line, name, text in found))


def test_family_name_allowances_are_still_needed():
    seen = {(rel, text) for rel, _, _, text in family_names_outside_models()}
    stale = [key for key in FAMILY_NAMES_ALLOWED if key not in seen]
    assert not stale, f"FAMILY_NAMES_ALLOWED entries that no literal needs any more (remove them): {stale}"


def test_the_family_check_sees_a_family_name():
    tree = ast.parse('x = cfg.model.arch == "bert"\nhelp = _f(1, "bert only")\ny = "model.preset=llava-tiny"')
    docs = _documentation(tree)
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and id(n) not in docs}
    assert literals == {"bert", "model.preset=llava-tiny"}


# ------------------------------------------------------------------------------ devices: megaloom/accelerator.py

# megaloom/accelerator.py is the one module that names a device type or calls a device runtime (issue 37: any
# accelerator torch knows, with its distributed backend). Everywhere else in megaloom/: no ``torch.cuda`` (nor an
# import of it), no ``.cuda`` / ``.is_cuda`` / ``.CUDA`` attribute (a tensor's ``.cuda()``, ``ProfilerActivity.CUDA``)
# but the module's own API (``accelerator.is_cuda``), and no string literal containing "cuda" in any case (a device
# type compared or built, "cuda:0", an autocast type, an env variable). Not checked: docstrings, comments and config
# help (`_f(default, help)`), which are documentation. CUDA-only paths compare with ``accelerator.CUDA`` or ask
# ``accelerator.is_cuda`` / ``cuda_capability``, so each stays visibly CUDA's.
# (path under megaloom/, the literal's text) -> why that literal may name CUDA.
CUDA_NAMED_ALLOWED = {
    ("config.py", "cuda, xpu, musa, npu, mps, ..."):
        "the accelerator types train.device's messages name; config.py imports no torch (every command loads it), "
        "so it cannot ask megaloom/accelerator.py, which imports this constant instead",
    ("fa4.py", "it needs a CUDA GPU"):
        "FA4 is a CUDA kernel (flash-attn-4): the refusal names what train.attention=fa4 needs as a fact",
    ("planning/levers.py", "CUDA"):
        "levers.MEASURED_ON: the speed levers were measured on CUDA (an H200), the reason each choice states",
}


def _cuda_names(rel: str, tree: ast.Module) -> list[tuple[str, int, str]]:
    """(path, line, what) for every use of CUDA by name in one module's code (see above)."""
    docs = _documentation(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.lower() in ("cuda", "is_cuda") and not (
                isinstance(node.value, ast.Name) and node.value.id == "accelerator"):
            found.append((rel, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] + ([module] if module else [])
            if any(n == "torch.cuda" or n.startswith("torch.cuda.") for n in names) or (
                    module == "torch" and any(a.name == "cuda" for a in node.names)):
                found.append((rel, node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and "cuda" in node.value.lower() and (rel, node.value) not in CUDA_NAMED_ALLOWED):
            found.append((rel, node.lineno, repr(node.value)))
    return found


def cuda_outside_accelerator() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel != "accelerator.py":
            found += _cuda_names(rel, _tree(path))
    return found


def test_no_cuda_outside_the_accelerator_module():
    found = cuda_outside_accelerator()
    assert not found, ("CUDA named outside megaloom/accelerator.py (ask the module: accelerator.is_accelerator, "
                       "is_cuda / CUDA for a CUDA-only path, synchronize, max_memory_allocated, streams, backend ...; "
                       "see CUDA_NAMED_ALLOWED for messages that may name it):\n"
                       + "\n".join(f"megaloom/{rel}:{line}: {what}" for rel, line, what in found))


def test_cuda_allowances_are_still_needed():
    seen = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = _tree(path)
        docs = _documentation(tree)
        seen |= {(rel, n.value) for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs}
    stale = [key for key in CUDA_NAMED_ALLOWED if key not in seen]
    assert not stale, f"CUDA_NAMED_ALLOWED entries that no literal needs any more (remove them): {stale}"


def test_the_cuda_check_sees_cuda():
    source = '''
"""A docstring may say torch.cuda."""
import torch.cuda
from torch import cuda
from megaloom import accelerator
x = torch.cuda.synchronize()
y = t.is_cuda or t.cuda() or ProfilerActivity.CUDA
z = d.type == "cuda" or f"cuda:{i}" or "CUDA_VISIBLE_DEVICES"
ok = accelerator.is_cuda(d) and accelerator.cuda_capability(d) and d.type == CUDA
help = _f("auto", "cuda if available")
'''
    found = _cuda_names("example.py", ast.parse(source))
    assert sorted(line for _, line, _ in found) == [3, 4, 6, 7, 7, 7, 8, 8, 8]
    assert ("example.py", 6, "torch.cuda") in found


# ------------------------------------------------------------------------- one rule per derived size

# A model size left at 0 ("auto") is filled in by one rule, in megaloom/model_keys/shape.py (issue 50, "resolve
# once"): n_kv_heads, head_dim, ffn_dim, expert_ffn_dim. Anywhere else, code asks `resolved_kv_heads(m)` and its
# siblings (which read the field of a resolved config): the rule written out again (``m.n_kv_heads or m.n_heads``,
# ``m.ffn_dim or ...``, ``m.d_model // m.n_heads``, a family's ``default_ffn_dim(...)``) is how two places came
# to disagree (a resolved head_dim written into a latent-attention run's config.yaml).
SHAPE_RULES_HOME = "model_keys/shape.py"
_AUTO_SIZES = ("n_kv_heads", "head_dim", "ffn_dim", "expert_ffn_dim")


def _shape_rules(rel: str, tree: ast.Module) -> list[tuple[str, int, str]]:
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or)
                and isinstance(node.values[0], ast.Attribute) and node.values[0].attr in _AUTO_SIZES):
            found.append((rel, node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv)
              and isinstance(node.left, ast.Attribute) and node.left.attr == "d_model"
              and isinstance(node.right, ast.Attribute) and node.right.attr == "n_heads"):
            found.append((rel, node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "default_ffn_dim"):
            found.append((rel, node.lineno, ast.unparse(node)))
    return found


def test_each_auto_size_has_one_rule():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel != SHAPE_RULES_HOME:
            found += _shape_rules(rel, _tree(path))
    assert not found, (f"a model size's 'auto' rule written outside megaloom/{SHAPE_RULES_HOME} (ask "
                       "resolved_kv_heads / resolved_head_dim / resolved_ffn_dim / resolved_expert_ffn_dim):\n"
                       + "\n".join(f"megaloom/{rel}:{line}: {what}" for rel, line, what in found))
    assert _shape_rules(SHAPE_RULES_HOME, _tree(ROOT / SHAPE_RULES_HOME)), "the rules' home no longer holds them"


def test_the_rule_check_sees_a_rule():
    source = """
kv = m.n_kv_heads or m.n_heads
hd = cfg.model.head_dim or cfg.model.d_model // cfg.model.n_heads
ffn = tr.default_ffn_dim(m.d_model)
fine = resolved_kv_heads(m) or m.vocab_size or d_model // n_heads
"""
    assert sorted(line for _, line, _ in _shape_rules("example.py", ast.parse(source))) == [2, 3, 3, 4]


# ------------------------------------------------------------------------- floors, and who may import whom

# The floors of megaloom, bottom first (docs/architecture.md, "Floors", draws them). A module stands on the floor of
# the longest entry naming it or a package above it; every room (a top-level package or module) must be placed. A
# room that holds two layers names its upper modules on their own floor (observe/log below the models, the rest of
# observe/ above the engine). Modules of one floor may import each other (both ways, as rooms: the module graph
# itself has no circle); an import of a higher floor is an arrow pointing up. UP_ARROWS_AT_MOST bounds those
# arrows, counted once per pair of entries.
FLOORS = [
    ["megaloom.errors", "megaloom.config", "megaloom.model_keys"],  # the vocabulary: exceptions, the typed config
    ["megaloom.accelerator", "megaloom.fa4", "megaloom.observe.log"],  # device (and its facts), kernels, logging
    ["megaloom.models"],  # the families and the shared decoder, their parallel plans as data
    ["megaloom.parallel"],  # the engine: mesh, collectives, tp/sp/cp/ep/pp, gradients, the launcher
    ["megaloom.data", "megaloom.observe", "megaloom.resilience", "megaloom.checkpoint",
     "megaloom.runtime"],  # services around the engine
    ["megaloom.preflight", "megaloom.optim", "megaloom.planning", "megaloom.convert",
     "megaloom.precision"],  # checks, optimizers, predictions, conversion, fp8 and the loss scaler
    ["megaloom.step", "megaloom.training"],  # the step and the loop
    # the commands (and the package's own __init__)
    ["megaloom", "megaloom.__main__", "megaloom.cli", "megaloom.train", "megaloom.generate", "megaloom.plot"],
]
UP_ARROWS_AT_MOST = 5
_FLOOR = {entry: i for i, entries in enumerate(FLOORS) for entry in entries}


def floor_entry(module: str) -> str | None:
    """The FLOORS entry that places ``module`` (the longest naming it or a package above it); None: unplaced."""
    if module == "megaloom":
        return module
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if (entry := ".".join(parts[:n])) in _FLOOR:
            return entry
    return None


def up_arrows(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(lower entry, higher entry) -> the module imports behind that arrow pointing up."""
    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for mod, targets in graph.items():
        for target in targets:
            a, b = floor_entry(mod), floor_entry(target)
            if a is not None and b is not None and _FLOOR[a] < _FLOOR[b]:
                out.setdefault((a, b), []).append((mod, target))
    return out


def test_every_module_has_a_floor():
    unplaced = sorted(m for m in import_graph() if floor_entry(m) is None)
    assert not unplaced, f"modules on no floor (add their room to FLOORS and to docs/architecture.md): {unplaced}"


def test_few_arrows_point_up():
    ups = up_arrows(import_graph(functions=True))
    listing = "\n".join(f"{a} -> {b}: {', '.join(f'{m} -> {t}' for m, t in sorted(pairs)[:3])}"
                        for (a, b), pairs in sorted(ups.items()))
    assert len(ups) <= UP_ARROWS_AT_MOST, (f"{len(ups)} arrows point up a floor (at most {UP_ARROWS_AT_MOST}; move the "
                                           f"shared piece down instead):\n{listing}")


def forbidden_imports() -> list[tuple[str, str, str]]:
    """(importer, imported, why) from docs/architecture.md's table "Forbidden imports": each a package or module
    whose modules may not import the other's, at load time or at call time."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    section = doc.split("### Forbidden imports", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`megaloom"):
            rows.append((cells[0].strip("`"), cells[1].strip("`"), cells[2]))
    return rows


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_forbidden_import():
    graph = import_graph(functions=True)
    found = [f"{mod} -> {target} (forbidden: {why})" for importer, imported, why in forbidden_imports()
             for mod, targets in graph.items() if _within(mod, importer)
             for target in sorted(targets) if _within(target, imported)]
    assert not found, "imports docs/architecture.md forbids:\n" + "\n".join(found)


def test_the_forbidden_table_is_read():
    rows = forbidden_imports()
    assert ("megaloom.models", "megaloom.parallel") in {(a, b) for a, b, _ in rows}
    modules = set(import_graph())
    for importer, imported, _ in rows:
        assert importer in modules and imported in modules, f"a forbidden-import row names no module: {importer}, " \
                                                            f"{imported}"


# Every function in megaloom/ fits on a screen: one that does not is split along its seams (a phase, a choice,
# a computation with its own name), each piece with a docstring that says what it owns.
LONGEST_FUNCTION = 80


def long_functions() -> list[tuple[str, int, str, int]]:
    """(path under megaloom/, line, name, lines from ``def`` to its last line) for every function over the limit."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > LONGEST_FUNCTION:
                    found.append((path.relative_to(ROOT).as_posix(), node.lineno, node.name, n))
    return found


def test_no_function_over_80_lines():
    found = long_functions()
    assert not found, (f"functions over {LONGEST_FUNCTION} lines (split them along their seams):\n"
                       + "\n".join(f"megaloom/{rel}:{line}: {name} ({n} lines)" for rel, line, name, n in found))
