"""Built-in models for examples, tests and benchmarks."""
