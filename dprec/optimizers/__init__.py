"""dprec.optimizers."""
