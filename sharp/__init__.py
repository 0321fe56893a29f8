"""sharp: make sharp attention normalizers deployable (docs/design.md).

Layers, lowest first: `sharp.models` (math, modules) ← `sharp.exporter`, `sharp.plugins` ← `sharp.serving`.
"""

__version__ = "0.1.0"
