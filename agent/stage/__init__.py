"""What a node serves: its order book and step handler, the step batcher, fragments, weights and whole copies."""
