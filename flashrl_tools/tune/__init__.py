"""`flashrl tune`: mixed precision within a KL budget (see run.py)."""
