"""dprec.layers."""
