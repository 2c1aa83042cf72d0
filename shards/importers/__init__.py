"""Importing models: GGUF and Hugging Face safetensors into the store, quantisation, pulling by name."""
