"""Runtime layer: launch ranks, run their programs in a step loop, checkpoint."""
