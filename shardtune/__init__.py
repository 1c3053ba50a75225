"""shardtune: fine-tune open LLMs on one GPU, many GPUs and many machines."""

__version__ = "0.1.0"
