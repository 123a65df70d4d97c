"""dprec.training: the streaming online trainer, callbacks, batch sampling."""
from dprec.training.period_source import ArrayPeriodSource
from dprec.training.period_source import BeamStreamSource
from dprec.training.period_source import Period
from dprec.training.period_source import PeriodSource
from dprec.training.plan import plan_stream
from dprec.training.plan import StreamPlan
from dprec.training.streaming import PeriodModel
from dprec.training.streaming import StreamConfig
from dprec.training.streaming import StreamingTrainer
