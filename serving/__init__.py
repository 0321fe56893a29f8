"""sharp.serving — filled by its own issue (see README layout)."""
