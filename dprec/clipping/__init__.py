"""dprec.clipping."""
