"""dprec.training: batch sampling, callbacks, checkpoints, the streaming period trainer."""
from dprec.training.period_source import ArrayPeriodSource
from dprec.training.period_source import BeamStreamSource
from dprec.training.period_source import Period
from dprec.training.period_source import PeriodSource
from dprec.training.streaming import PeriodModel
from dprec.training.streaming import StreamConfig
from dprec.training.streaming import StreamingTrainer
