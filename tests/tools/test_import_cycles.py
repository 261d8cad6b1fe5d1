"""No import cycles among the project's Python modules (tools/import_cycles.py, CI)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("import_cycles", os.path.join(ROOT, "tools", "import_cycles.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycles(capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool()
    graph, modules = tool.build_graph(ROOT)
    assert "mori_core.ops.dispatch_combine" in modules and "mori_integrations.vllm.plugin" in modules
    found = tool.cycles(graph)
    report = "\n".join(line for comp in found for line in tool.describe(graph, comp))
    assert not found, f"import cycles (a module imports a module that imports it back):\n{report}"


def test_the_tool_sees_a_function_level_cycle(tmp_path) -> None:
    tool = _tool()
    pkg = tmp_path / "python" / "mori_core"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from mori_core import b\n")
    (pkg / "b.py").write_text("def f():\n    from mori_core.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mori_core import a\n")
    (pkg / "d.py").write_text("from . import c\n")
    graph, _ = tool.build_graph(str(tmp_path))
    assert tool.cycles(graph) == [["mori_core.a", "mori_core.b"]]
    assert graph.edges["mori_core.b"] == {"mori_core.a": "function"}
    assert graph.edges["mori_core.c"] == {} and graph.edges["mori_core.d"] == {"mori_core.c": "module"}
