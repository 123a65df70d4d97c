"""The package's layering (docs/layout.md): models are models only, the layers below the
workflows never import them, and the command-line modules only parse and call."""
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dprec"
JOBS = PACKAGE.parent / "pipelines"
MAX_LINES = 600


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


SEAM = PACKAGE / "beam_jobs.py"
JOB_MODULE = re.compile(r"pipelines(\.\w+)+")


def _module_strings(path):
  """The string constants of `path` that name a module of the Beam jobs (`pipelines.x`)."""
  return {node.value for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
          if isinstance(node, ast.Constant) and isinstance(node.value, str)
          and JOB_MODULE.fullmatch(node.value)}


def test_only_the_seam_reaches_the_beam_jobs():
  """The Beam jobs use the library, never the reverse: no dprec module but `dprec.beam_jobs`
  imports `pipelines` or names one of its modules for importlib."""
  for path in sorted(PACKAGE.rglob("*.py")):
    if path == SEAM:
      continue
    reached = {name for name in _imports(path) if name.split(".")[0] == "pipelines"}
    assert not reached | _module_strings(path), path


def test_the_seams_jobs_exist_with_their_descriptions():
  """Each job `dprec.beam_jobs` names is a module of `pipelines` defining its description class
  and `run` (read, not imported: Beam takes seconds to import)."""
  tree = ast.parse(SEAM.read_text(encoding="utf-8"))
  jobs = [node.args for node in ast.walk(tree) if isinstance(node, ast.Call)
          and getattr(node.func, "id", None) == "Job"]
  assert jobs
  for module, description in ((a.value, b.value) for a, b in jobs):
    source = PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")
    defined = {node.name for node in ast.parse(source.read_text(encoding="utf-8")).body
               if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    assert {description, "run"} <= defined, source


def test_no_module_of_the_library_or_the_jobs_is_over_600_lines():
  """A module that outgrows 600 lines holds more than one responsibility: split it by what its
  parts hold (docs/layout.md)."""
  sizes = {str(path.relative_to(PACKAGE.parent)): len(path.read_text(encoding="utf-8").splitlines())
           for root in (PACKAGE, JOBS) for path in sorted(root.rglob("*.py"))}
  assert not {path: lines for path, lines in sizes.items() if lines > MAX_LINES}
