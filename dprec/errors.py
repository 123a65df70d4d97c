"""User-facing errors: the CLI prints these as one line, without a traceback."""


class DprecError(Exception):
  """Base class for errors caused by the user's input or configuration."""

  # Keras (3 and tf-keras) re-raises an error from inside a layer's call with the call's
  # arguments appended, unless it carries this mark: a refusal in a DP step stays one line.
  _keras_call_info_injected = True


class InputError(DprecError):
  """Malformed input data, located by file, line number and field."""

  def __init__(self, path, line, field, reason):
    self.path, self.line, self.field, self.reason = path, line, field, reason
    super().__init__(f"{path}:{line}: field {field}: {reason}")


class BudgetExceededError(DprecError):
  """A privacy charge (or a planned run) would exceed the configured budget."""
