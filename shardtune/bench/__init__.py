"""Benchmarks that ship with shardtune: ``shardtune bench strategies`` (``strategies``) and the training callback
that measures each setup's steps (``probe``), which plugs into the trainer like any user's callback."""

PROBE_CALLBACK = "shardtune.bench.probe:Probe"  # what the bench passes to every setup's --callbacks
PROBE_DIR = "probe"  # the probe's records go to OUTPUT_DIR/probe/probe-rank-R.json
