"""dprec.training: batch sampling, callbacks, checkpoints, the streaming period trainer (its names
imported on first use: `dprec.lazy`)."""
from dprec import lazy

_NAMES = {**{name: "dprec.training.period_source"
             for name in ("ArrayPeriodSource", "BeamStreamSource", "Period", "PeriodSource")},
          "PeriodModel": "dprec.training.period_model",
          "StreamConfig": "dprec.training.stream_config",
          "StreamingTrainer": "dprec.training.streaming"}
__all__ = sorted(_NAMES)
__getattr__ = lazy.exports(__name__, _NAMES, globals())
