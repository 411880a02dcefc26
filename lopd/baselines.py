"""Baseline training objectives registered in :data:`lopd.trainer.METHODS`."""
