"""KV memory: the torch backend's page pool and its prefix names, the graph backends' batch cache and prefix store."""
