"""A package's names imported on first use (PEP 562 module `__getattr__`): `import dprec` stays
cheap, and a TensorFlow-free submodule imports without TensorFlow through its package's
`__init__` (the command line parses arguments, and refuses bad ones, before it loads TensorFlow)."""
import importlib


def exports(package: str, names: dict, namespace: dict):
  """The `__getattr__` of `package` returning the attribute `name` of module `names[name]`,
  imported when first asked for and then kept in `namespace` (the package's `globals()`)."""

  def __getattr__(name):
    if name not in names:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = namespace[name] = getattr(importlib.import_module(names[name]), name)
    return value

  return __getattr__
