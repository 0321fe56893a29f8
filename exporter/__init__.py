"""sharp.exporter — filled by its own issue (see README layout)."""
