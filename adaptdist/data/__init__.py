"""Training data sources."""
