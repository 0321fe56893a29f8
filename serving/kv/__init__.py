"""KV memory: the page names every prefix cache is indexed by, the torch backend's page pool, the graph backends'
batch cache and prefix store."""
