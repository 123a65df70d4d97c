"""dprec.training."""
