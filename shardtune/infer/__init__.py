"""Inference on a trained model or adapter: greedy or sampled generation with a KV cache, and a chat session
(``generate``)."""
