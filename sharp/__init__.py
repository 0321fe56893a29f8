"""sharp: make sharp attention normalizers deployable (SPEC §1).

Layers, lowest first: `sharp.models` (math, modules) ← `sharp.exporter`, `sharp.plugins` ← `sharp.serving`.
"""

__version__ = "0.1.0"
