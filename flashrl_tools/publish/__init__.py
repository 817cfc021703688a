"""`flashrl publish` and Hub references: share one config + profile per model through the HF Hub."""
