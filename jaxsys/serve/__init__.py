"""Serving: generation with a KV cache (decode.py); `python -m jaxsys.generate` is its command."""
