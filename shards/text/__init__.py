"""Tokenizers and chat templates, and their specs as found in GGUF files and Hugging Face folders."""
