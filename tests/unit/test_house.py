"""The house rules, read from the code: packages import each other one way (no cycle, imports
inside functions included), no public class name is defined twice, every file or folder that
appears by renaming goes through gyre.common.files, and rank operations are functions, not strings."""

import ast
import re
from collections import defaultdict
from pathlib import Path

GYRE = Path(__file__).resolve().parents[2] / "gyre"


def _modules() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(GYRE.rglob("*.py"))}


def _package(path: Path) -> str:
    """gyre/<package>/... -> <package>; a top-level module (gyre/config.py) is a package of its own."""
    return path.relative_to(GYRE).parts[0].removesuffix(".py")


def import_graph() -> dict[str, dict[str, set[str]]]:
    """{package: {package it imports: the files that do}}, every import statement counted."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] if node.module != "gyre" else [f"gyre.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "gyre" and len(parts) > 1 and parts[1] != _package(path):
                    graph[_package(path)][parts[1]].add(str(path.relative_to(GYRE)))
    return graph


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str]:
    """One cycle of packages (first package repeated at the end), or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_no_package_imports_a_package_that_imports_it_back():
    graph = import_graph()
    cycle = find_cycle(graph)
    where = [f"{a} -> {b}: {sorted(graph[a][b])}" for a, b in zip(cycle, cycle[1:])]
    assert not cycle, "\n".join(where)


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    graph = {"a": {"b": {"a/x.py"}}, "b": {"c": {"b/y.py"}}, "c": {"a": {"c/z.py (inside a function)"}}}
    assert find_cycle(graph) == ["a", "b", "c", "a"] and find_cycle({"a": {"b": set()}, "b": {}}) == []


def test_no_public_class_name_is_defined_twice():
    where = defaultdict(list)
    for path, tree in _modules().items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(str(path.relative_to(GYRE)))
    assert not {name: files for name, files in where.items() if len(files) > 1}


def test_renames_go_through_the_atomic_write_helper_and_rank_ops_are_not_strings():
    renames, string_ops = [], []
    for path in GYRE.rglob("*.py"):
        text = path.read_text()
        if path != GYRE / "common" / "files.py" and re.search(r"os\.replace\(|os\.rename\(|\.rename\(", text):
            renames.append(str(path.relative_to(GYRE)))
        if 'ranks.call("' in text:
            string_ops.append(str(path.relative_to(GYRE)))
    assert not renames and not string_ops, (renames, string_ops)


TOOLS = GYRE.parent / "tools"


def _sources(*, tools: bool = True) -> dict[str, str]:
    """{path relative to the repository: text} of gyre/ (and tools/) Python files."""
    paths = [*GYRE.rglob("*.py"), *(TOOLS.rglob("*.py") if tools else ())]
    return {str(p.relative_to(GYRE.parent)): p.read_text() for p in sorted(paths)}


def _outside(home: str, pattern: str, *, tools: bool = True) -> list[str]:
    """Files other than `home` in which `pattern` (a regex) occurs."""
    return [path for path, text in _sources(tools=tools).items() if path != home and re.search(pattern, text, re.M)]


def test_json_is_read_and_written_through_one_module():
    assert not _outside("gyre/common/jsonio.py", r"^\s*(import (json|orjson)\b|from (json|orjson) import)")


def test_sse_is_framed_in_one_place():
    assert not _outside("gyre/common/sse.py", r"sse_response\(|text/event-stream|b\"data: ")


def test_children_die_with_their_parent_through_one_helper():
    assert not _outside("gyre/common/spawn.py", r"preexec_fn=|prctl\(")


def test_no_port_is_picked_by_binding_port_0_and_closing():
    """A port bound to 0 and closed is handed to whoever binds next: gyre.common.ports reserves it."""
    picker = r"\.bind\(\(\s*[^,()]+,\s*0\s*\)\)|def free_port\b"
    tests = [p for p in (GYRE.parent / "tests").rglob("*.py") if p != Path(__file__).resolve()]
    assert not _outside("gyre/common/ports.py", picker) + [str(t) for t in tests if re.search(picker, t.read_text())]


def test_run_directory_names_are_spelled_in_run_paths_alone():
    files = r"\"(events\.jsonl|ledger\.jsonl|summary\.json|\.hydra)\""
    folders = r"/ \"(records|sandboxes|checkpoints|slurm|weights)\""
    assert not _outside("gyre/common/run_paths.py", f"{files}|{folders}")
