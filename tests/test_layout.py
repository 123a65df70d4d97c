"""The package's layering (docs/layout.md): models are models only, the layers below the
workflows never import them, and the command-line modules only parse and call."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dprec"


def _imports(path):
  """Every module name `path` imports (absolute, as written)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_models_import_no_argparse_ledger_or_workflow():
  for path in sorted((PACKAGE / "models").glob("*.py")):
    imported = _imports(path)
    assert not {name for name in imported
                if name == "argparse" or "ledger" in name.lower() or "workflows" in name}, path


def test_only_the_workflows_and_above_import_the_workflows():
  below = ["clipping", "data", "layers", "models", "optimizers", "privacy", "sparse", "training"]
  for package in below:
    for path in sorted((PACKAGE / package).glob("*.py")):
      assert not any(name.startswith("dprec.workflows") for name in _imports(path)), path


def test_command_line_modules_only_parse_and_call():
  """A workflow's `*_cli` module imports only argparse, the command line's help and aliases
  (`dprec.cli_help`, argparse only) and the workflows."""
  for path in sorted((PACKAGE / "workflows").glob("*_cli.py")):
    imported = {name.split(".")[0] if not name.startswith("dprec.") else name
                for name in _imports(path)}
    assert imported <= {"argparse", "dataclasses"} | {
        name for name in imported if name.startswith(("dprec.workflows", "dprec.cli_help"))}, path
