"""The embedded demo: a bundled base model, a generated task, and the before/after evaluation of a fine-tune."""
