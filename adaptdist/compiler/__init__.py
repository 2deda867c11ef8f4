"""Compiler layer: capture a model's training step as one joint graph, then lower it per rank."""
