"""KV memory: the graph backends' batch cache and their prefix store."""
