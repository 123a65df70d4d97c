"""dprec.sparse."""
