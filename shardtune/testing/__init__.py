"""Tiny models and tokenizers (``tiny``) that the tests, the benchmarks and the demo build: real Hugging Face folders,
nothing downloaded."""
