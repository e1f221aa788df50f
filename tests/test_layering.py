"""Dependencies point one way (issue #23 item 4; the rule is in docs/architecture.md, "Dependencies").

pyvis: no import circle at all.  Every import statement counts, wherever it stands: at module level, inside a
function (a lazy import is still a dependency) or under ``if TYPE_CHECKING:`` (a type is a dependency too: the
fix for a circle is a module both sides can import, or a protocol, not hiding the import).
``from pkg import name`` depends on the module ``pkg.name`` when there is one, else on ``pkg`` (the name comes
from its ``__init__``); the implicit import of a module's parent packages is not counted (every submodule has it).

src/: modules are file stems (``vis-moe-context.h`` and ``.cpp`` are one module), joined by ``#include "..."``.
The strongly-connected components left are an explicit allow-list: a circle may shrink or vanish (then shrink
the list), but no module may join one and no new circle may appear.  The cache core knows its features only
through the feature interface (src/core/vis-moe-feature.h): no core module includes a feature's header.
The folders of src/ are its layers (plan and vlm on top, then features, core, store, api): a file includes only
files of its own folder or of a folder below it; today's exceptions are an allow-list that may only shrink.

One mutator (issue #23 item 2): pass 0's planners write a ubatch plan (src/core/vis-moe-ubatch-plan.h) and only the
context's apply() (src/core/vis-moe-apply.cpp) changes the slot pools and starts reads.  A feature's source writes
no layer's applied plan, calls no read starter (``vis_moe_fetch_submit``, the fetcher's ``submit``) and no slot-pool
writer; the features that still do it outside pass 0 (the stream op, the shadow passes, the end of a ubatch) are an
explicit allow-list that may only shrink.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULE = ("docs/architecture.md, \"Dependencies\": dependencies point one way (in src/, down the folders: plan, vlm "
        "-> features -> core -> store -> api; in pyvis, cli -> parts -> runtime); break a circle by moving the shared "
        "piece into a module both sides import")

# src/ modules in an include circle today (issue #23 had 13 modules in one; the feature interface removed it).
# This list may only shrink.
KNOWN_SRC_CIRCLES = [
    {"vis-moe-predict", "vis-moe-predict-mlp"},
]

# The cache core (docs/architecture.md, "Dependencies": api -> context -> features -> pool/policy -> store/io) ...
CORE_MODULES = {"vis-moe-context", "vis-moe-passes", "vis-moe-slot-pool", "vis-moe-policy", "vis-moe-graph",
                "vis-moe-ops", "vis-moe-attach", "vis-moe-attach-plan", "vis-moe-attach-upload", "vis-moe-transfer",
                "vis-moe-fetch", "vis-moe-fetch-slots", "vis-moe-upload", "vis-moe-feature", "vis-moe-store",
                "vis-moe-io-pool", "vis-moe-host-cache", "vis-moe-deferred", "vis-moe-apply",
                "vis-moe-ubatch-plan"}
# ... and the features: the mechanisms behind vis_moe_feature (src/core/vis-moe-feature.h) and the modules only they use
FEATURE_MODULES = {"vis-moe-substitute", "vis-moe-substitute-stats", "vis-moe-prefetch", "vis-moe-prefetch-ab", "vis-moe-predict",
                   "vis-moe-predict-mlp", "vis-moe-precision", "vis-moe-shadow", "vis-moe-shadow-slots",
                   "vis-moe-capacity", "vis-moe-modality", "vis-moe-stage", "vis-moe-lend", "vis-moe-trace",
                   "vis-moe-replay", "vis-moe-telemetry", "vis-moe-telemetry-probe", "vis-moe-topk", "vis-moe-online",
                   "vis-moe-encoder-release", "vis-moe-borrow"}
# Core modules that still reach a feature by name: the graph builds the nodes of prefetch, replay and staging, the
# ops run the shadow passes, and attach creates the features (a new feature joins its list).  Otherwise only shrinks.
KNOWN_CORE_FEATURE_INCLUDES = {
    "vis-moe-graph": {"vis-moe-prefetch", "vis-moe-replay", "vis-moe-stage"},
    "vis-moe-ops": {"vis-moe-precision", "vis-moe-shadow-slots"},
    "vis-moe-attach": {"vis-moe-borrow", "vis-moe-capacity", "vis-moe-encoder-release", "vis-moe-lend", "vis-moe-modality", "vis-moe-online", "vis-moe-precision",
                       "vis-moe-prefetch",
                       "vis-moe-replay", "vis-moe-shadow", "vis-moe-stage", "vis-moe-substitute", "vis-moe-telemetry",
                       "vis-moe-topk", "vis-moe-trace"},
    "vis-moe-attach-plan": {"vis-moe-shadow"},
}

# What a feature's source may not do (the context's apply() does it): name -> pattern, on the source without comments
CACHE_MUTATIONS = {
    "starts a read": re.compile(r"\bvis_moe_fetch_submit\s*\(|\bfetch\s*->\s*submit\s*\("),
    "writes a slot pool": re.compile(r"\b(?:slots|pool)\s*\.\s*(?:place|reserve|evict|release|settle|forget_all|limit)\s*\(|"
                                     r"\bpolicy\s*\(\s*\)\s*\.\s*(?:touch|hold|speculate|end_step)\s*\("),
    "writes the applied ubatch plan": re.compile(
        r"\bubatch_plan\s*\.\s*\w+\s*(?:\[[^\]]*\]\s*)?(?:=(?!=)|\.\s*(?:assign|push_back|emplace_back|clear|resize)\s*\()"),
    "runs a pass or applies a plan": re.compile(r"\bvis_moe_run_pass\s*\(|\.\s*apply\s*\(\s*il\b|\bplanning\b"),
}
# Features that still change the cache themselves, outside pass 0's plan: prefetch's end of ubatch counts the
# speculative horizons down (its reads ahead go through the context's apply_reads), the stream op stages (stage) or
# empties the slots to lend their memory (lend), the shadow passes fill the shadow pool (shadow-slots).  Only shrinks.
KNOWN_FEATURE_MUTATIONS = {
    "vis-moe-prefetch": {"writes a slot pool"},
    "vis-moe-stage": {"starts a read"},
    "vis-moe-lend": {"writes a slot pool"},
    "vis-moe-shadow-slots": {"writes a slot pool"},
}

# The layer folders of src/ by rank (docs/architecture.md, "Folders"): a file may include files of its own folder
# and of folders of a lower rank, never of a higher one or of another folder of its own rank.
SRC_FOLDERS = {"plan": 4, "vlm": 4, "features": 3, "core": 2, "store": 1, "api": 0}
# Includes that go up a folder today, besides the core's feature includes above (KNOWN_CORE_FEATURE_INCLUDES): the
# settings table parses the policy's words into its enum (api -> core), the attach applies --moe-mode and checks
# the files options name (core -> features), and the stats' C getters read the features' structs.  Only shrinks.
KNOWN_UPWARD_INCLUDES = {
    "vis-moe-settings-table": {"vis-moe-policy"},
    "vis-moe-attach": {"vis-moe-mode", "vis-moe-named-files"},
    "vis-moe-stats": {"vis-moe-capacity", "vis-moe-precision", "vis-moe-prefetch", "vis-moe-substitute"},
}


# --------------------------------------------------------------------------
# the graphs
# --------------------------------------------------------------------------
def python_imports(root: Path, package: str = "pyvis") -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (every import statement of its AST)."""
    files = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)

    def resolve(name: str) -> str | None:     # the innermost module of ours that `name` lies in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, (path, is_pkg) in files.items():
        here = mod if is_pkg else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1] +
                                    ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else resolve(base) for a in node.names}
        graph[mod] = {d for d in deps if d and d != mod}
    return graph


def include_graph(root: Path) -> dict[str, set[str]]:
    """module (file stem under src/) -> the modules whose headers it includes."""
    files = sorted(p for ext in ("*.h", "*.cpp") for p in (root / "src").rglob(ext))
    stem = lambda name: Path(name).name.split(".")[0]  # noqa: E731
    graph = {stem(p.name): set() for p in files}
    for p in files:
        for inc in re.findall(r'^\s*#\s*include\s*"([^"]+)"', p.read_text(), re.M):
            if stem(inc) in graph and stem(inc) != stem(p.name):
                graph[stem(p.name)].add(stem(inc))
    return graph


def src_folders(root: Path) -> dict[str, set[str]]:
    """module (file stem under src/) -> the folders its files lie in ("" for a file directly in src/)."""
    out: dict[str, set[str]] = {}
    for ext in ("*.h", "*.cpp", "*.c"):
        for p in (root / "src").rglob(ext):
            out.setdefault(p.name.split(".")[0], set()).add(p.parent.relative_to(root / "src").as_posix().strip("."))
    return out


def misplaced(folders: dict[str, set[str]]) -> list[str]:
    """What breaks the folder layout: a file outside the layer folders, a module split over two folders."""
    out = []
    for m, fs in sorted(folders.items()):
        if len(fs) > 1:
            out.append(f"{m}: its files lie in {sorted(fs)}; a module's .h and .cpp share one folder")
        out += [f"{m}: in src/{f + '/' if f else ''}, not in a layer folder (src/{{{','.join(SRC_FOLDERS)}}}/)"
                for f in sorted(fs) if f not in SRC_FOLDERS]
    return out


def upward_includes(graph: dict[str, set[str]], folders: dict[str, set[str]]) -> dict[str, set[str]]:
    """module -> the modules it includes from a folder of a higher rank or another folder of its rank."""
    where = {m: next(iter(fs)) for m, fs in folders.items() if len(fs) == 1 and next(iter(fs)) in SRC_FOLDERS}
    up = lambda a, b: a != b and SRC_FOLDERS[b] >= SRC_FOLDERS[a]  # noqa: E731
    out = {m: {d for d in deps if d in where and up(where[m], where[d])}
           for m, deps in graph.items() if m in where}
    return {m: ds for m, ds in sorted(out.items()) if ds}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly-connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def _show(cs: list[set[str]]) -> str:
    return "\n".join(f"  {len(c)}: {' '.join(sorted(c))}" for c in sorted(cs, key=lambda c: (-len(c), sorted(c))))


# --------------------------------------------------------------------------
# the rules
# --------------------------------------------------------------------------
def test_pyvis_has_no_import_circle():
    found = circles(python_imports(ROOT))
    assert not found, f"import circles in pyvis:\n{_show(found)}\n{RULE}"


def test_only_the_entry_point_imports_the_cli():
    """runtime, vlm, testbed, fixtures, calibrate (everything) reach the shared pieces (pyvis.progress) directly:
    the command line sits on top and nothing below it imports it."""
    graph = python_imports(ROOT)
    assert "pyvis.cli" in graph and "pyvis.progress" in graph["pyvis.cli"]
    importers = {m for m, deps in graph.items() if "pyvis.cli" in deps}
    assert importers == {"pyvis.__main__"}, f"{sorted(importers - {'pyvis.__main__'})} import pyvis.cli. {RULE}"
    for part in ("pyvis.runtime", "pyvis.vlm", "pyvis.testbed", "pyvis.fixtures"):
        assert not {m for m in importers if m == part or m.startswith(part + ".")}


def test_the_parts_sit_on_runtime():
    """Between subpackages, too, dependencies point one way: cli -> calibrate, vlm, demo -> testbed -> runtime;
    runtime (the C API's mirror and what wraps it) imports none of the parts above it."""
    graph = python_imports(ROOT)
    part = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    parts = {}
    for m, deps in graph.items():
        parts.setdefault(part(m), set()).update(part(d) for d in deps if part(d) != part(m))
    assert not circles(parts), f"circles between pyvis's parts:\n{_show(circles(parts))}\n{RULE}"
    above = {"pyvis.cli", "pyvis.calibrate", "pyvis.vlm", "pyvis.testbed", "pyvis.fixtures", "pyvis.demo", "pyvis.moe"}
    assert not parts["pyvis.runtime"] & above, f"pyvis.runtime imports {sorted(parts['pyvis.runtime'] & above)}. {RULE}"


def test_src_include_circles_only_shrink():
    graph = include_graph(ROOT)
    found = circles(graph)
    print(f"src/ include circles ({len(graph)} modules):\n{_show(found)}")
    for c in found:   # each circle lies inside one known circle: no module joined one, no circle is new
        assert any(c <= known for known in KNOWN_SRC_CIRCLES), (
            f"new include circle in src/ (or one that grew):\n{_show([c])}\nknown:\n{_show(KNOWN_SRC_CIRCLES)}\n{RULE}")
    in_circle = set().union(*found) if found else set()
    left = set().union(*KNOWN_SRC_CIRCLES) - in_circle
    assert not left, (f"{' '.join(sorted(left))} no longer in an include circle: good, remove them from "
                      "KNOWN_SRC_CIRCLES so that they cannot fall back into one")


def core_feature_includes(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """core module -> the feature modules whose headers it includes (only those that include any)."""
    return {m: graph[m] & FEATURE_MODULES for m in sorted(CORE_MODULES & set(graph)) if graph[m] & FEATURE_MODULES}


def test_the_core_includes_no_feature():
    graph = include_graph(ROOT)
    assert CORE_MODULES <= set(graph) and FEATURE_MODULES <= set(graph), (
        f"unknown modules named: {sorted((CORE_MODULES | FEATURE_MODULES) - set(graph))}")
    assert not CORE_MODULES & FEATURE_MODULES
    found = core_feature_includes(graph)
    for m, feats in found.items():
        extra = feats - KNOWN_CORE_FEATURE_INCLUDES.get(m, set())
        assert not extra, (f"{m} (cache core) includes feature headers {sorted(extra)}: reach a feature through "
                           f"vis_moe_feature (src/core/vis-moe-feature.h) instead. {RULE}")
    for m, feats in KNOWN_CORE_FEATURE_INCLUDES.items():
        gone = feats - found.get(m, set())
        assert not gone, (f"{m} no longer includes {sorted(gone)}: good, remove them from "
                          "KNOWN_CORE_FEATURE_INCLUDES so that they cannot come back")
    # the context itself, and the pool, policy and passes below it, include none at all
    for m in ("vis-moe-context", "vis-moe-passes", "vis-moe-slot-pool", "vis-moe-policy", "vis-moe-transfer",
              "vis-moe-fetch", "vis-moe-fetch-slots"):
        assert m not in found, f"{m} includes feature headers {sorted(found[m])}. {RULE}"


def test_every_src_file_lies_in_a_layer_folder():
    bad = misplaced(src_folders(ROOT))
    assert not bad, ("src/ files outside the layer folders (docs/architecture.md, \"Folders\"; put a new file in "
                     "the folder of its layer and add it to CMakeLists.txt):\n  " + "\n  ".join(bad))


def test_src_includes_point_down_the_folders():
    graph, folders = include_graph(ROOT), src_folders(ROOT)
    known = {m: KNOWN_UPWARD_INCLUDES.get(m, set()) | KNOWN_CORE_FEATURE_INCLUDES.get(m, set())
             for m in KNOWN_UPWARD_INCLUDES.keys() | KNOWN_CORE_FEATURE_INCLUDES.keys()}
    found = upward_includes(graph, folders)
    print("src/ includes up a folder:\n" + "\n".join(f"  {m} -> {' '.join(sorted(d))}" for m, d in found.items()))
    for m, deps in found.items():
        extra = deps - known.get(m, set())
        assert not extra, (f"{m} (src/{next(iter(folders[m]))}/) includes "
                           f"{', '.join(f'{d} (src/{next(iter(folders[d]))}/)' for d in sorted(extra))}: up a "
                           f"folder. {RULE}")
    for m, deps in KNOWN_UPWARD_INCLUDES.items():
        gone = deps - found.get(m, set())
        assert not gone, (f"{m} no longer includes {sorted(gone)} up a folder: good, remove them from "
                          "KNOWN_UPWARD_INCLUDES so that they cannot come back")


def test_the_module_lists_agree_with_the_folders():
    """CORE_MODULES lie in core/ or store/, FEATURE_MODULES in features/: the folders show what the lists say."""
    folders = src_folders(ROOT)
    for names, allowed in ((CORE_MODULES, {"core", "store"}), (FEATURE_MODULES, {"features"})):
        wrong = {m: sorted(folders[m]) for m in sorted(names) if m in folders and not folders[m] <= allowed}
        assert not wrong, f"{wrong}: move them to src/{' or src/'.join(sorted(allowed))}/ (or fix the list)"


def feature_mutations(root: Path) -> dict[str, set[str]]:
    """feature module -> the CACHE_MUTATIONS its .cpp files do (only those that do any)."""
    out = {}
    for p in sorted((root / "src").rglob("*.cpp")):
        mod = p.name.split(".")[0]
        if mod not in FEATURE_MODULES:
            continue
        text = re.sub(r"//[^\n]*|/\*.*?\*/", "", p.read_text(), flags=re.S)
        found = {name for name, pat in CACHE_MUTATIONS.items() if pat.search(text)}
        if found:
            out.setdefault(mod, set()).update(found)
    return out


def test_only_apply_changes_the_cache():
    found = feature_mutations(ROOT)
    for m, what in found.items():
        extra = what - KNOWN_FEATURE_MUTATIONS.get(m, set())
        assert not extra, (f"{m} (a feature) {', '.join(sorted(extra))}: plan it instead (a field or a read of the "
                           "ubatch plan, src/core/vis-moe-ubatch-plan.h) and let vis_moe_context::apply do it")
    for m, what in KNOWN_FEATURE_MUTATIONS.items():
        gone = what - found.get(m, set())
        assert not gone, (f"{m} no longer {', '.join(sorted(gone))}: good, remove it from KNOWN_FEATURE_MUTATIONS "
                          "so that it cannot come back")
    # the planners of pass 0 are clean: they write only the plan
    for m in ("vis-moe-substitute", "vis-moe-precision", "vis-moe-capacity", "vis-moe-trace"):
        assert m not in found, f"{m} {', '.join(sorted(found[m]))}"


# --------------------------------------------------------------------------
# the checkers see what they must
# --------------------------------------------------------------------------
def test_the_import_checker_sees_lazy_typing_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom . import d\n")
    (pkg / "sub" / "d.py").write_text("from pkg import A\n")     # a name of the package: depends on its __init__
    graph = python_imports(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"}, "pkg.sub": set(),
                     "pkg.sub.c": {"pkg.a", "pkg.sub.d"}, "pkg.sub.d": {"pkg"}}
    assert sorted(map(sorted, circles(graph))) == [["pkg", "pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.d"]]


def test_the_include_checker_joins_header_and_source(tmp_path):
    (tmp_path / "src").mkdir()
    for name, text in {"a.h": "", "a.cpp": '#include "a.h"\n#include "b.h"\n', "b.h": "",
                       "b.cpp": '#include "b.h"\n #include "c.h"\n#include <vector>\n', "c.h": '#include "a.h"\n',
                       "d.cpp": '#include "a.h"\n'}.items():
        (tmp_path / "src" / name).write_text(text)
    graph = include_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [{"a", "b", "c"}]


def test_the_core_check_sees_a_feature_include(tmp_path):
    (tmp_path / "src").mkdir()
    for name, text in {"vis-moe-context.h": '#include "vis-moe-feature.h"\n', "vis-moe-feature.h": "",
                       "vis-moe-context.cpp": '#include "vis-moe-context.h"\n#include "vis-moe-lend.h"\n',
                       "vis-moe-lend.h": "", "vis-moe-lend.cpp": '#include "vis-moe-context.h"\n'}.items():
        (tmp_path / "src" / name).write_text(text)
    graph = include_graph(tmp_path)
    assert core_feature_includes(graph) == {"vis-moe-context": {"vis-moe-lend"}}
    assert circles(graph) == [{"vis-moe-context", "vis-moe-lend"}]


def test_the_folder_check_sees_an_upward_include_and_a_stray_file(tmp_path):
    for name, text in {"core/vis-moe-context.h": '#include "llama-vis.h"\n', "api/llama-vis.h": "",
                       "core/vis-moe-context.cpp": '#include "vis-moe-context.h"\n#include "vis-moe-lend.h"\n',
                       "features/vis-moe-lend.h": '#include "vis-moe-context.h"\n',
                       "api/vis-moe-settings.cpp": '#include "vis-moe-store.h"\n', "store/vis-moe-store.h": "",
                       "plan/vis-moe-plan.cpp": '#include "vis-vlm.h"\n', "vlm/vis-vlm.h": "",
                       "vis-moe-flat.cpp": "", "core/vis-moe-split.h": "", "store/vis-moe-split.cpp": "",
                       "extra/vis-moe-odd.h": ""}.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_text(text)
    folders = src_folders(tmp_path)
    assert upward_includes(include_graph(tmp_path), folders) == {
        "vis-moe-context": {"vis-moe-lend"},          # core -> features: up
        "vis-moe-settings": {"vis-moe-store"},        # api -> store: up
        "vis-moe-plan": {"vis-vlm"}}                  # plan -> vlm: a folder of the same rank
    assert [line.split(":")[0] for line in misplaced(folders)] == ["vis-moe-flat", "vis-moe-odd", "vis-moe-split"]


def test_the_mutation_check_sees_a_planner_that_writes_the_cache(tmp_path):
    (tmp_path / "src" / "features").mkdir(parents=True)
    (tmp_path / "src" / "core").mkdir()
    (tmp_path / "src" / "features" / "vis-moe-substitute.cpp").write_text(
        "// vis_moe_fetch_submit(vm, L, il, e, false) in a comment is fine\n"
        "void f(vis_moe_context & vm, vis_moe_layer & L) {\n"
        "    const vis_fetch_result r = vis_moe_fetch_submit(vm, L, il, e, false);\n"
        "    L.ubatch_plan.sub_active = true;\n"
        "    if (L.ubatch_plan.exec[j] == e) {}\n"
        "    L.shadow.pool.evict(s);\n}\n")
    (tmp_path / "src" / "features" / "vis-moe-capacity.cpp").write_text(
        "void g(vis_ubatch_plan & plan) { plan.exec.assign(n, 0); plan.sub_active = true; }\n")
    (tmp_path / "src" / "core" / "vis-moe-apply.cpp").write_text("void h() { vis_moe_fetch_submit(vm, L, il, e, false); }\n")
    assert feature_mutations(tmp_path) == {
        "vis-moe-substitute": {"starts a read", "writes the applied ubatch plan", "writes a slot pool"}}
