"""ATLAS: input-conditioned residual updates that keep retained behaviour.

Pure torch + transformers. Imports no orchestration, tracking or database code.
"""
