"""Training: the model as transformers builds it, one ``parallelize`` that makes it DDP / FSDP2 / checkpointed,
one step function for every strategy, and the loop that ties them to data, checkpoints and metrics."""
