"""dprec.training: batch sampling, callbacks, checkpoints, the streaming period trainer (its names
imported on first use: `dprec.lazy`)."""
from dprec import lazy

_NAMES = {**{name: "dprec.training.period_source"
             for name in ("ArrayPeriodSource", "BeamStreamSource", "Period", "PeriodSource")},
          **{name: "dprec.training.streaming"
             for name in ("PeriodModel", "StreamConfig", "StreamingTrainer")}}
__all__ = sorted(_NAMES)
__getattr__ = lazy.exports(__name__, _NAMES, globals())
