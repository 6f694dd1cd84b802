"""The sync's machinery, in four subpackages with a strict import order (lowest first):
runtime < tensors < links < ft. A subpackage imports only from those below it (and from
hier_localsgd.costs / errors); tests/test_layers.py checks it, docs/architecture.md draws it.
"""
