"""Torch modules: the decoder (llama.py), its layers and attention over the paged cache."""
