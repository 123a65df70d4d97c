"""How a streaming run proceeds (`StreamConfig`): checkpoints, periods, waiting, the top-k set,
table headroom, diagnostics."""
import dataclasses
from typing import Mapping, Optional, Union


@dataclasses.dataclass(frozen=True)
class StreamConfig:
  """How a streaming run proceeds (the privacy side is the plan, the run directory the `Run`).

  Attributes:
    checkpoint_every: steps between mid-period checkpoints (one is always written at period end).
    train_periods: periods to train (later complete periods are the final hold-out); None: all.
    idle_timeout: seconds to wait for the next period before finishing (0: stop when caught up).
    poll_interval: seconds between looks at the source while waiting.
    top_k: rows per table (int, or {table: k}) of the DP-FEST / DP-AdaFEST+ set refreshed every
      period from the running counts; by DP top-k when the plan reserves selection ε, else from
      the counts as they are (public). None: the algorithm has no fixed set.
    headroom: tables are allocated with this factor of spare rows and grown by it when new ids
      outrun them, so a model is rebuilt (and its step retraced) rarely, not every period.
    diagnostics: also keep the non-private diagnostics (exact period sizes, batch sizes, training
      loss) under `diagnostics_nonprivate`.
  """
  checkpoint_every: int = 100
  train_periods: Optional[int] = None
  idle_timeout: float = 0.0
  poll_interval: float = 1.0
  top_k: Optional[Union[int, Mapping[str, int]]] = None
  headroom: float = 1.5
  diagnostics: bool = False

  def __post_init__(self):
    if self.checkpoint_every < 1:
      raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
    if self.headroom < 1:
      raise ValueError(f"headroom must be >= 1, got {self.headroom}")
