import sys

from shardtune.cli import command

sys.exit(command())
