"""Speculative decoding: proposers (prompt lookup / n-gram, a draft model) and the verification
of their proposals as multi-token rows of the normal mixed step (rejection sampling, exact)."""
