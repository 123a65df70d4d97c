"""dprec: differentially private training for large-embedding recommender models."""

__version__ = "0.1.0"
