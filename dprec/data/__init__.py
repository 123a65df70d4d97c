"""dprec.data."""
