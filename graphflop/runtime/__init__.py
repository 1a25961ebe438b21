"""Running graphflop's graphs on real tensors: numerics checks and timing."""
