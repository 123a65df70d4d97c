"""dprec.models."""
