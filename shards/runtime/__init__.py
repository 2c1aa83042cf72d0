"""Running fragments: runners and chains, the KV pool, sampling, local generation."""
