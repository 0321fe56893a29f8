"""sharp.plugins — filled by its own issue (see README layout)."""
