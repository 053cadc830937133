"""loraplex on Ray Serve: engine replicas, adapter-residency routing, the OpenAI ingress.

Names are imported lazily: ``loraplex serve-ray --help`` imports neither Ray nor torch.
"""
