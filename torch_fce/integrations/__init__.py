"""Integrations with other libraries (kernels never import these)."""
