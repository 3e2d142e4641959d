"""Training: the drafter trainer (stages `backbone` and `ar`), causal-LM pre-training for the reference
target and draft LM, data builders and atomic, resumable checkpoints."""
