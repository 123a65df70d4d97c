"""Apache Beam pipelines for dprec."""
